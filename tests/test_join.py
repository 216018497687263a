"""lite.join on real gloo processes: uneven shards, collectives anywhere, no_grad eval.

Each case runs tests/scripts/join_run.py and checks what every rank saw and computed
against a single-process replay of the same data and sharding.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import batches, make_data, make_model, reference_training, shards  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CASES = [
    # strategy, ranks, samples, batch size, divide_by_initial_world_size
    ("ddp", 2, 5, 2, True),  # rank 1 has one batch fewer
    ("ddp", 3, 10, 1, True),  # rank 0 has one batch more
    ("ddp", 3, 2, 1, True),  # rank 2 has no batch at all
    ("ddp", 2, 7, 2, False),  # gradients averaged over the ranks still active
    ("single", 1, 7, 2, True),  # the same script on one process
]


def _flat(params):
    return [x for p in params for x in p]


@pytest.mark.parametrize(("strategy", "world", "n", "batch", "divide"), CASES)
def test_join_uneven(script, strategy, world, n, batch, divide):
    result = script("join_run", strategy, world, n, batch, int(divide))
    assert result.returncode == 0, result.explain()
    ranks = result.json()
    assert [r["rank"] for r in ranks] == list(range(world))

    exact = shards(n, world, pad=False)
    per_rank_batches = [batches(s, batch) for s in exact]

    # The sampler: each sample exactly once inside join, padded even counts outside.
    for r in ranks:
        assert r["seen"] == exact[r["rank"]]
        assert r["len_inside"] == len(per_rank_batches[r["rank"]])
        assert r["len_outside"] == math.ceil(math.ceil(n / world) / batch)
        assert len(r["padded_seen"]) == math.ceil(n / world)
    assert sorted(i for r in ranks for i in r["seen"]) == list(range(n))
    assert set(i for r in ranks for i in r["padded_seen"]) == set(range(n))

    # Every collective inside join covers exactly the ranks still active at that step.
    steps = max(len(b) for b in per_rank_batches)
    for step in range(steps):
        active = [r for r in range(world) if step < len(per_rank_batches[r])]
        locals_ = [ranks[r]["train"][step]["local"] for r in active]
        for r in active:
            got = ranks[r]["train"][step]
            assert got["idx"] == per_rank_batches[r][step]
            assert got["active_top"] == len(active)
            assert got["mean"] == pytest.approx(sum(locals_) / len(active), rel=1e-6)
            assert got["sum"] == pytest.approx(sum(locals_), rel=1e-6)
            assert got["max_rank"] == max(active) and got["min_rank"] == min(active)
            assert got["gathered"] == active
            assert got["from0"] == {"hello": 0}
            assert got["nested"] == {"a": [len(active), 2.0 * len(active)]}

    # Training: parameters identical on all ranks and equal to the single-process replay.
    reference = reference_training(n, world, batch, divide_by_initial=divide)
    expected = _flat([p.detach().flatten().tolist() for p in reference.parameters()])
    for r in ranks:
        assert _flat(r["params"]) == _flat(ranks[0]["params"])
        assert _flat(r["params"]) == pytest.approx(expected, abs=1e-5)

    # Evaluation under no_grad in join: the metric equals the single-process metric.
    x, y = make_data(n).tensors
    with torch.no_grad():
        sse = torch.nn.functional.mse_loss(reference(x), y, reduction="sum").item()
    for r in ranks:
        assert r["metric"][1] == n
        assert r["metric"][0] == pytest.approx(sse, rel=1e-5)
    # ... and the running per-step reduction covers the active ranks' batches only.
    for step in range(steps):
        active = [r for r in range(world) if step < len(per_rank_batches[r])]
        count = sum(len(per_rank_batches[r][step]) for r in active)
        for r in active:
            assert ranks[r]["eval"][step]["running"][1] == count


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("zero", "ZeroRedundancyOptimizer"),
        ("static_graph", "static_graph=True"),
    ],
)
def test_join_refuses_what_torch_join_cannot_survive(script, case, expected):
    result = script("join_refusals", case)
    assert result.returncode == 0, result.explain()
    for rank, out in enumerate(result.json()):
        assert out[str(rank)].startswith("ValueError") and expected in out[str(rank)]


def test_broadcast_from_a_rank_that_left_join_is_an_error_not_a_hang(script):
    result = script("join_refusals", "broadcast_from_joined")
    assert result.returncode == 1, result.explain()
    assert "RuntimeError: lite.broadcast(src=1) inside lite.join: rank 1 has already run out of data" in result.stderr
    assert "raised on rank 0 of 2" in result.stderr
    assert result.seconds < 20


def test_a_raw_torch_collective_inside_join_is_an_error_naming_it_not_a_hang(script):
    result = script("join_refusals", "raw_collective")
    assert result.returncode == 1, result.explain()
    assert "RuntimeError: torch.distributed.all_reduce was called inside lite.join (at " in result.stderr
    assert "join_refusals.py:" in result.stderr and "metric.compute()` after" in result.stderr
    assert "CollectiveTimeoutError" not in result.stderr
    assert result.seconds < 25  # it used to wait for the whole timeout (30 s here), then fail


def test_a_rank_leaving_join_by_an_exception_makes_the_others_raise_in_step(script):
    result = script("join_refusals", "abort")
    assert result.returncode == 0, result.explain()
    rank0, rank1 = result.json()[0], result.json()[1]
    assert rank0["0"] == "KeyError: 'rank 0 fails inside join'"
    assert rank1["1"].startswith("PeerLeftJoinError: Another rank left lite.join by an exception")
    # the abort round kept the ranks in step: the next collective is a collective again
    assert rank0["after"] == rank1["after"] == 40.0


# -- every strategy over a process group: lockstep zero-weighted replay ---------------------------

# (ranks, batches per rank, divide_by_initial_world_size, optimizer, max_norm)
TWO = (2, "5,3", True, "adamw", 0.5)
THREE = (3, "5,3,0", False, "sgd", 0.5)  # rank 2 has no batch at all
# "accumulate": each batch as two micro-batches, the first in lite.no_backward_sync (the same
# gradient, so the same reference); DeepSpeed accumulates by its config instead.
REPLAY_CASES = [
    ("fsdp", TWO, ""),
    ("fsdp", THREE, "accumulate"),
    ("deepspeed_stage_3", TWO, ""),
    ("deepspeed_stage_3_offload", THREE, ""),  # optimizer and parameters offloaded to the CPU
    ("deepspeed_stage_2", TWO, ""),
    ("deepspeed_stage_1", THREE, ""),
]
DDP_EXTRA = {TWO: "", THREE: "accumulate"}
_ddp_runs: dict[tuple, list] = {}


def _replay_reference(counts, divide, kind, max_norm, batch=2):
    """One process: per step, the active ranks' mean-loss gradients summed and divided by the
    world size (or the active count), clipped by global norm, then step, scheduler, zero_grad;
    two epochs over the same per-rank batches (the script's loop)."""
    model = make_model()
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x, y = make_data(batch * sum(counts)).tensors
    starts = [sum(counts[:r]) for r in range(len(counts))]
    for _ in range(2):
        for step in range(max(counts)):
            active = [r for r in range(len(counts)) if step < counts[r]]
            total = [torch.zeros_like(p) for p in model.parameters()]
            for r in active:
                b = starts[r] + step
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x[batch * b : batch * (b + 1)]), y[batch * b : batch * (b + 1)]).backward()
                for t, p in zip(total, model.parameters()):
                    t += p.grad
            for t, p in zip(total, model.parameters()):
                p.grad = t / (len(counts) if divide else len(active))
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            sched.step()
            opt.zero_grad()
    with torch.no_grad():
        sse = torch.nn.functional.mse_loss(model(x), y, reduction="sum").item()
    return _flat([p.detach().flatten().tolist() for p in model.parameters()]), opt.param_groups[0]["lr"], sse, len(x)


def _replay_run(script, strategy, config, *extra):
    ranks, counts, divide, kind, max_norm = config
    result = script("join_sharded", strategy, ranks, counts, int(divide), kind, max_norm, *[e for e in extra if e], timeout=150)
    assert result.returncode == 0, result.explain()
    return result.json()


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("strategy", "config", "extra"), REPLAY_CASES, ids=lambda v: v if isinstance(v, str) else f"{v[0]}ranks-{v[1]}")
def test_join_trains_like_ddp_and_one_process_under_sharded_strategies(script, strategy, config, extra):
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    ranks_, counts_text, divide, kind, max_norm = config
    counts = [int(c) for c in counts_text.split(",")]
    ranks = _replay_run(script, strategy, config, extra)
    if config not in _ddp_runs:  # the same script under ddp, once per configuration
        _ddp_runs[config] = _replay_run(script, "ddp", config, DDP_EXTRA[config])
    ddp = _ddp_runs[config]
    params, lr, sse, n = _replay_reference(counts, divide, kind, max_norm)

    for r in ranks:
        # training: every rank ends with the same parameters, those of ddp and one process
        assert _flat(r["params"]) == pytest.approx(params, abs=1e-5)
        assert _flat(r["params"]) == pytest.approx(_flat(ddp[r["rank"]]["params"]), abs=1e-5)
        assert r["lr"][-1] == pytest.approx(lr, rel=1e-12)  # the scheduler was mirrored
        # each rank ran its own batches only, in both epochs
        assert len(r["steps"]) == 2 * counts[r["rank"]]
        # collectives before the forward and between forward and backward: active ranks only
        for i, step in enumerate(r["steps"]):
            s = i % counts[r["rank"]]
            active = [q for q in range(ranks_) if s < counts[q]]
            assert step["active"] == len(active)
            peers = [ranks[q]["steps"][step["epoch"] * counts[q] + s]["local"] for q in active]
            assert step["sum"] == pytest.approx(sum(peers), rel=1e-5)
        # no_grad evaluation inside join: every sample once, the one-process metric
        assert r["metric"][1] == n
        assert r["metric"][0] == pytest.approx(sse, rel=1e-5)


def test_a_replay_that_does_not_mirror_the_optimizer_step_is_caught(script):
    """The control: joined ranks that skip optimizer.step end far from the reference."""
    config = THREE
    counts = [int(c) for c in config[1].split(",")]
    ranks = _replay_run(script, "fsdp", config, "nostep")
    params, _, _, _ = _replay_reference(counts, config[2], config[3], config[4])
    assert max(abs(a - b) for a, b in zip(_flat(ranks[0]["params"]), params)) > 1e-3


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_3"])
def test_join_refuses_what_a_joined_rank_cannot_mirror(script, strategy):
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_replay_refusals", strategy, "batched", timeout=90)
    assert result.returncode == 0, result.explain()
    for errors in result.json():  # every rank raised, together: nobody hangs
        assert errors["plain"].startswith("TypeError") and "lite.setup(model" in errors["plain"] and "not set up in this run" in errors["plain"]
        assert errors["lr_by_hand"].startswith("RuntimeError") and "changed from 0.1 to 0.5" in errors["lr_by_hand"]
        assert "LR scheduler" in errors["lr_by_hand"]
        assert errors["disagree"].startswith("RuntimeError") and "announced different steps" in errors["disagree"]
        assert errors["plateau"].startswith("RuntimeError") and "ReduceLROnPlateau" in errors["plateau"]
        assert errors["two_forwards"].startswith("RuntimeError") and "loss built from several forwards" in errors["two_forwards"]
        if strategy == "fsdp":  # deepspeed refuses lite.clip_gradients altogether
            assert errors["unknown_optimizer"].startswith("ValueError") and "not set up in this run" in errors["unknown_optimizer"]
        assert errors["after"] == 2


def test_a_scheduler_stepped_after_the_loop_inside_join_is_an_error_not_a_hang(script):
    result = script("join_replay_refusals", "fsdp", "sched_after_loop", timeout=90)
    assert result.returncode == 1, result.explain()
    assert "rank 1 raised RuntimeError: Inside lite.join a rank that ran out of data did" in result.stderr
    assert "after the loop but inside the join block" in result.stderr
    assert result.seconds < 40
