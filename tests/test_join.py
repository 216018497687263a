"""lite.join on real gloo processes: uneven shards, collectives anywhere, no_grad eval.

Each case runs tests/scripts/join_run.py and checks what every rank saw and computed
against a single-process replay of the same data and sharding.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import batches, make_data, make_model, max_diff, reference_training, shards

pytestmark = pytest.mark.timeout(120)

RUNS = [
    # strategy, ranks, configurations (samples, batch size, divide_by_initial_world_size)
    ("ddp", 2, [(5, 2, True), (9, 2, False)]),  # rank 1 has one batch fewer; averaged over the active
    ("ddp", 3, [(10, 1, True), (2, 1, True)]),  # rank 0 has one batch more; rank 2 has no batch at all
    ("single", 1, [(7, 2, True)]),  # the same script on one process
]


def _flat(params):
    return [x for p in params for x in p]


@pytest.mark.parametrize(("strategy", "world", "configs"), RUNS, ids=lambda v: v if isinstance(v, str) else str(v))
def test_join_uneven(script, strategy, world, configs):
    result = script("join_run", strategy, world, ",".join(f"{n}:{b}:{int(d)}" for n, b, d in configs))
    assert result.returncode == 0, result.explain()
    everyone = result.json()
    for k, (n, batch, divide) in enumerate(configs):
        _check_join_run([records[k] for records in everyone], world, n, batch, divide)
    _check_free_when_even([records[-1]["even_rounds"] for records in everyone], world)


def _check_free_when_even(rounds, world):
    """Over a set-up loader on even data, one round (an all-gather of every rank's step message) when the pass
    begins and none per step: 5 steps cost what 2 do. Over a plain list, one round per step
    from the third (its backward's, not waited for while every rank runs; the first two
    forwards have rounds of their own) and one at the end: 3 steps more cost 3 rounds more.
    One device: no round at all."""
    expected = {"2": 1, "5": 1, "list2": 5, "list5": 8} if world > 1 else dict.fromkeys(("2", "5", "list2", "list5"), 0)
    for rank, counts in enumerate(rounds):
        assert counts == expected, f"rank {rank}: all-gathers {counts}"


def _check_join_run(ranks, world, n, batch, divide):
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
    assert {i for r in ranks for i in r["padded_seen"]} == set(range(n))

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
    if len({len(b) for b in per_rank_batches}) > 1:  # a rank leaves early: the divisor shows
        other = reference_training(n, world, batch, divide_by_initial=not divide)
        assert max_diff(expected, _flat([p.detach().flatten().tolist() for p in other.parameters()])) > 1e-4

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
    assert "raised on rank 0 of 2" in result.stderr  # before launch(timeout=300): no timeout ended it


@pytest.mark.parametrize(
    ("strategy", "catch"),
    [("fsdp", "uncaught"), ("fsdp", "inside"), ("fsdp", "outside"), ("deepspeed_stage_3", "inside")],
)
def test_a_forward_raising_midway_on_one_rank_ends_the_run_with_its_error(script, strategy, catch):
    """Rank 1's forward raises between two of its gathers inside lite.join; rank 0 waits in
    the next one. The abort round of the protocol met that all-gather and gloo aborted the
    process, the user's KeyError lost (under NCCL: a hang). Now the run ends at once with the
    KeyError where nothing catches it; where the script catches it (inside the block, going
    on to its next batch, or outside it, going on to a collective) with "cannot go on" at
    this rank's next step, which names the way out."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_forward_raises", strategy, catch, timeout=90)
    assert result.returncode == 1, result.explain()
    assert "EnforceNotMet" not in result.stderr and "Aborted" not in result.stderr, result.explain()
    assert "the run went on" not in result.stderr, result.explain()
    if catch == "uncaught":
        assert "rank 1 raised KeyError: 'rank 1 fails inside its forward'" in result.stderr, result.explain()
    else:
        assert "rank 1 raised RuntimeError: This rank" in result.stderr, result.explain()
        assert "cannot go on: inside lite.join a forward of model 0 raised on this rank between two of its" in (
            result.stderr
        )
        assert 'lite.all_reduce(float(not ok), op="max")' in result.stderr


def test_a_raw_torch_collective_inside_join_is_an_error_naming_it_not_a_hang(script):
    result = script("join_refusals", "raw_collective")
    assert result.returncode == 1, result.explain()
    assert "RuntimeError: torch.distributed.all_reduce was called inside lite.join (at " in result.stderr
    assert "join_refusals.py:" in result.stderr and "metric.compute()` after" in result.stderr
    assert "CollectiveTimeoutError" not in result.stderr  # it used to wait for the whole timeout, then fail


def test_what_a_joined_rank_cannot_mirror_is_refused_on_every_rank_at_once(script):
    """One fsdp launch. Collectives of different shapes on the running ranks: over a set-up
    loader (every rank has data: no rounds) gloo used to read past the shorter tensor (made-up
    values) or abort; over a plain loop the refusal showed two identical steps. And nanoGPT's
    torch.nn.utils.clip_grad_norm_ on FSDP's DTensor gradients inside lite.join all-reduced
    over the ranks that had run out: it hung until SIGINT; so did a weight norm to log
    (``sum(p.norm() ** 2 ...)``, reaching the others through torch's functional collectives).
    Now the first call raises on every rank, naming the fix (launch(timeout=300): a hang would
    be ended by the test's timeout, not by this error). A DTensor handed to lite.all_reduce is
    refused, naming full_tensor() and to_local()."""
    result = script("join_refusals", "unmirrorable")
    assert result.returncode == 0, result.explain()
    calls = {
        "clip": "torch.nn.utils.clip_grad_norm_",
        "total": "torch.nn.utils.get_total_norm",
        "full": "DTensor.full_tensor()",
        "norms": "A DTensor operation (torch's functional all_reduce)",
    }
    for rank, out in enumerate(result.json()):
        for name in ("loader_gather", "loader_reduce"):
            kind = name.split("_")[1]
            error = out[f"{rank}:{name}"]
            assert error.startswith(f"ShapeMismatchError: lite.all_{kind} was called with different shapes"), error
            assert f"rank 0: lite.all_{kind}" in error and "float32[2]" in error and "float32[3]" in error
        gathered, reduced = out[f"{rank}:list_gather"], out[f"{rank}:list_reduce"]
        assert "called the same collective with tensors of different shapes" in gathered, gathered
        assert (
            "rank 0: lite.all_gather of float32[2] at " in gathered
            and "rank 1: lite.all_gather of float32[3]" in gathered
        )
        assert "rank 1: lite.all_reduce(op='sum') of float32[3]" in reduced and "gather_for_metrics" in reduced
        assert "after the loop" not in gathered  # the unrelated hint is gone
        for name, call in calls.items():
            error = out[f"{rank}:{name}"]
            assert error.startswith(f"RuntimeError: {call} was called inside lite.join (at "), error
            assert "join_refusals.py:" in error
        assert "lite.clip_gradients(model, optimizer, max_norm=...)" in out[f"{rank}:clip"]
        assert "`t.to_local()` for this rank's shard" in out[f"{rank}:norms"]
        dtensor = out[f"{rank}:dtensor"]
        assert dtensor.startswith("TypeError: lite.all_reduce got a DTensor") and "t.full_tensor()" in dtensor
        assert out["after"] > 0  # outside the block torch's own call goes through, in step


def test_a_rank_leaving_join_by_an_exception_makes_the_others_raise_in_step(script):
    result = script("join_refusals", "abort")
    assert result.returncode == 0, result.explain()
    rank0, rank1 = result.json()[0], result.json()[1]
    assert rank0["0"] == "KeyError: 'rank 0 fails inside join'"
    assert rank1["1"].startswith("PeerLeftJoinError: Another rank left lite.join by an exception")
    # the abort round kept the ranks in step: the next collective is a collective again
    assert rank0["after"] == rank1["after"] == 40.0
    # While both run, rank 0 does not wait for its backward's round: rank 1, failing before its
    # backward, reads that round in its abort round and runs the backward (zero gradients) so
    # that rank 0's gradient all-reduce meets it; rank 0 raises at its next round.
    for where, message in (("before_backward", "before its backward"), ("after_backward", "after its backward")):
        assert rank1[where]["error"] == f"KeyError: 'rank 1 fails {message}'", rank1[where]
        assert rank0[where]["error"].startswith("PeerLeftJoinError: Another rank left lite.join"), rank0[where]
        assert rank0[where]["after"] == rank1[where]["after"] == 3.0  # 1 + 2: still a pair


# -- refusals under the sharded strategies -------------------------------------------------------


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_3"])
def test_join_refuses_what_a_joined_rank_cannot_mirror(script, strategy):
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_replay_refusals", strategy, "batched", timeout=90)
    assert result.returncode == 0, result.explain()
    for errors in result.json():  # every rank raised, together: nobody hangs
        assert (
            errors["plain"].startswith("TypeError")
            and "lite.setup(model" in errors["plain"]
            and "not set up in this run" in errors["plain"]
        )
        assert errors["lr_by_hand"].startswith("RuntimeError") and "changed from 0.1 to 0.5" in errors["lr_by_hand"]
        assert "LR scheduler" in errors["lr_by_hand"]
        assert errors["disagree"].startswith("RuntimeError") and "announced different steps" in errors["disagree"]
        assert errors["plateau"].startswith("RuntimeError") and "ReduceLROnPlateau" in errors["plateau"]
        assert (
            errors["two_forwards"].startswith("RuntimeError")
            and "loss built from several forwards" in errors["two_forwards"]
        )
        # clip_gradients with an optimizer set up in no run (DeepSpeed clips inside join too:
        # test_join_training_suite_every_strategy): the join session refuses it under both
        unknown = errors["unknown_optimizer"]
        assert (
            unknown.startswith("ValueError") and "lite.join got an optimizer that was not set up in this run" in unknown
        ), unknown
        assert errors["after"] == 2
    _check_aborts(result.json())


ABORTS = {  # case: the rank that raises, and its message
    "replaying": (0, "rank 0 fails while rank 1 replays"),
    "mid_step": (0, "rank 0 fails between its forward and its backward"),
    "both_run": (1, "rank 1 fails between its forward and its backward"),
    "out_of_data": (1, "rank 1 fails after its loop, inside the block"),
}


def _check_aborts(everyone):
    """A rank left the block by an exception: it got its own, every other rank
    PeerLeftJoinError, and the next collective paired (rank values 1 + 2): no hang, no shift."""
    assert len(everyone) == 2
    for rank, errors in enumerate(everyone):
        assert sorted(errors["aborts"]) == sorted(ABORTS)
        for case, (raiser, message) in ABORTS.items():
            got = errors["aborts"][case]
            if rank == raiser:
                assert got["error"] == f"KeyError: {message!r}", (case, rank, got)
            else:
                assert got["error"].startswith("PeerLeftJoinError: Another rank left lite.join by an exception"), (
                    case,
                    rank,
                    got,
                )
            assert got["after"] == 3.0, (case, rank, got)


def test_a_scheduler_stepped_after_the_loop_inside_join_is_an_error_not_a_hang(script):
    result = script("join_replay_refusals", "fsdp", "sched_after_loop", timeout=90)
    assert result.returncode == 1, result.explain()
    assert (
        "rank 1 raised RuntimeError: Inside lite.join the ranks did different optimizer/scheduler calls"
        in result.stderr
    )
    assert "after the loop but inside the join block" in result.stderr


# -- torch's own uneven-input scenarios (distributed_test.py), many per launch ------------------

from _torch_models import (  # noqa: E402
    reference_equivalence,
    reference_eval,
    reference_even,
    reference_grad_div,
    reference_train,
    reference_uneven,
    scenarios,
)


def _close(got, expected, what, rel=1e-5, abs_=1e-5):
    """Each tensor (a flat list) as ``a == pytest.approx(b, rel=rel, abs=abs_)`` judges it,
    value by value: equal, or ``|a - b| <= max(rel * |b|, abs_)`` (a NaN never passes), in
    float64 as Python computes it; vectorised: pytest.approx took 12 of the 21 s of checks
    of torch's uneven suite."""
    assert len(got) == len(expected), f"{what}: {len(got)} tensors, expected {len(expected)}"
    for k, (a, b) in enumerate(zip(got, expected)):
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        assert a.shape == b.shape, f"{what}: tensor {k} has {a.numel()} values, expected {b.numel()}"
        diff = (a - b).abs()
        ok = (a == b) | (diff <= torch.clamp(rel * b.abs(), min=abs_))
        assert bool(ok.all()), f"{what}: tensor {k} differs by up to {float(diff[~ok].max())}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_torch_uneven_input_suite_under_ddp_ends_as_torch_join(script, world):
    """test_ddp_uneven_inputs (5 models x no_sync every 1/2/3 x every mapping, with a rank of
    zero iterations), grad division, model equivalence and even inputs: parameters and buffers
    equal on every rank and to what plain torch computes for torch's Join."""
    result = script("join_torch_suite", "ddp", world, "torch", timeout=280)
    assert result.returncode == 0, result.explain()
    ranks = result.json()
    cases = scenarios("torch", "ddp", world)
    assert [len(r) for r in ranks] == [len(cases)] * world
    for n, case in enumerate(cases):
        what = f"scenario {n} {case}"
        records = [ranks[r][n] for r in range(world)]
        for r, record in enumerate(records):  # the same model on every rank: parameters and buffers
            assert record["params"] == records[0]["params"] and record["buffers"] == records[0]["buffers"], (
                f"{what}: rank {r}"
            )
        if case["run"] == "uneven":
            expected = reference_uneven(case, world)
            assert [rec["done"] for rec in records] == [case["mapping"][r] for r in range(world)], what
            _close(records[0]["params"], expected["params"], what)
            _close(records[0]["buffers"], expected["buffers"], what + " buffers")
        elif case["run"] == "grad_div":
            expected_grads = reference_grad_div(case, world)
            for r, record in enumerate(records):
                assert len(record["grads"]) == len(expected_grads[r]), f"{what}: rank {r}"
                for got, want in zip(record["grads"], expected_grads[r]):  # torch's tolerance
                    assert got == pytest.approx(want, rel=1e-6), f"{what}: rank {r}"
        elif case["run"] == "equivalence":
            _close(records[0]["params"], reference_equivalence(world)["params"], what)
        elif case["run"] == "even":
            for record in records:
                assert record["grads"] == pytest.approx(reference_even(world)), what


TRAIN_SUITES = [
    ("ddp", 2),
    ("ddp", 3),
    ("fsdp", 2),
    ("fsdp", 3),
    ("deepspeed_stage_1", 2),
    ("deepspeed_stage_2", 3),
    ("deepspeed_stage_3", 2),
    ("deepspeed_stage_3_offload", 3),
]


def _train_run(script, strategy, world, *extra):
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_torch_suite", strategy, world, "train", *extra, timeout=280)
    assert result.returncode == 0, result.explain()
    ranks = result.json()
    cases = scenarios("train", strategy, world)
    assert [len(r) for r in ranks] == [len(cases)] * world
    return ranks, cases


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "world"), TRAIN_SUITES)
def test_join_training_suite_every_strategy(script, strategy, world):
    """SGD or AdamW with a StepLR, accumulation windows of 1-3 micro-batches (a rank running
    out in the middle of one), a BatchNorm net, clipping by norm and by value, both divisors,
    a rank with no batch, collectives between forward and backward and after the loop inside
    the block, a no_grad evaluation; loops over a set-up loader (free while every rank has
    data) and over range(). Parameters equal on every rank and to plain torch; buffers the
    last joiner's under ddp (as torch's Join), each rank's own under fsdp and deepspeed."""
    ranks, cases = _train_run(script, strategy, world)
    for n, case in enumerate(cases):
        what = f"scenario {n} {case}"
        if case["run"] == "eval":  # uneven: the ranks leave the loop after different numbers of batches
            assert [ranks[r][n]["batches"] for r in range(world)] == {2: [4, 3], 3: [3, 2, 2]}[world], what
            for r in range(world):
                assert ranks[r][n]["metric"] == pytest.approx(reference_eval(), rel=1e-5), what
            continue
        if case["run"] == "equivalence":
            for r in range(world):
                _close(ranks[r][n]["params"], reference_equivalence(world)["params"], f"{what}: rank {r}")
            continue
        if case["run"] == "grad_div":  # fsdp: each rank's shard of the gradient
            expected_grads = reference_grad_div(case, world)
            for r in range(world):
                got = ranks[r][n]["grads"]
                assert len(got) == len(expected_grads[r]), f"{what}: rank {r}"
                for shard, full in zip(got, expected_grads[r]):
                    assert shard == pytest.approx([full[0]] * len(shard), rel=1e-6), f"{what}: rank {r}"
            continue
        expected = reference_train(case, world, ddp=strategy == "ddp")
        mapping = case["mapping"]
        for r in range(world):
            record = ranks[r][n]
            assert record["total"] == sum(mapping.values()), what
            assert len(record["steps"]) == mapping[r], what
            for i, (_, summed) in enumerate(record["steps"]):  # over the ranks active at step i
                peers = [ranks[q][n]["steps"][i][0] for q in range(world) if i < mapping[q]]
                assert summed == pytest.approx(sum(peers), rel=1e-5), f"{what}: rank {r} step {i}"
            assert record["lr"] == pytest.approx(expected[r]["lr"], rel=1e-12), what  # the scheduler was mirrored
            _close(record["params"], expected[r]["params"], f"{what}: rank {r}")
            _close(record["buffers"], expected[r]["buffers"], f"{what}: rank {r} buffers")
            if strategy == "ddp":  # each rank's own optimizer state, as one process's
                _close(record["moments"], expected[r]["moments"], f"{what}: rank {r} optimizer state")


@pytest.mark.timeout(300)
def test_a_replay_that_does_not_mirror_the_optimizer_step_is_caught(script):
    """The control: serving ranks that skip optimizer.step end away from the reference."""
    ranks, cases = _train_run(script, "fsdp", 2, "nostep")
    worst = 0.0
    for n, case in enumerate(cases):
        if case["run"] == "train" and case["mapping"][0] == 0:  # rank 0 serves from the start
            expected = reference_train(case, 2, ddp=False)
            got = [x for t in ranks[0][n]["params"] for x in t]
            want = [x for t in expected[0]["params"] for x in t]
            worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
    assert worst > 1e-3


def test_a_step_message_encodes_and_decodes_itself():
    """The wire message of the join protocol: every field survives the float64 row, None too,
    and only the step's own fields (not a rank's bookkeeping) decide whether ranks agree."""
    from scopedlite._strategies.join.message import LENGTH, Action, Event, Header, Kind, Round, Step

    said = Step(
        Kind.COLLECTIVE,
        site=2**31 - 5,
        model=3,
        optimizer=2,
        grad=True,
        sync=False,
        buffers=True,
        mask=2**47 + 1,
        seq=12345,
        lr=0.30000000000000004,
        max_norm=None,
        clip_val=-0.5,
        norm_type=float("inf"),
        ended=2,
        reports=True,
        needs=5,
        length=-1,
        scheduler_steps=7,
        header=Header(1, 2, 4, (3, 1, 7), 1, 2),
        events=(Event(Action.OPTIMIZER_STEP, 1, 0.30000000000000004), Event(Action.SCHEDULER_STEP, 0)),
    )
    row = said.encode()
    assert len(row) == LENGTH
    assert Step.decode(row) == said
    assert Step.decode(Step(Kind.CLIP, max_norm=1.0).encode()).max_norm == 1.0
    assert said.with_events((), False, 0, 0).key() == said.key()  # bookkeeping: not the step
    assert dataclasses.replace(said, sync=True).key() != said.key()
    left = Step(Kind.LEFT, ended=3)
    round_ = Round([row, left.encode(), Step(Kind.COLLECTIVE, site=7, ended=2).encode()])
    assert round_.alive == [0, 2] and round_.runners == [0, 2] and round_.waiters == []
    assert "different steps" in round_.disagreement()  # another call site: never matched
    ahead = Round([Step(Kind.FORWARD, ended=0).encode(), Step(Kind.COLLECTIVE, site=7, ended=1).encode()])
    assert ahead.runners == [0] and ahead.waiters == [1] and ahead.disagreement() is None


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_a_rank_skipping_a_backward_the_others_run_is_refused_on_every_rank_or_counts_zero(script, strategy):
    """While every rank runs, a backward's round does not wait (lean rounds); a rank that skips
    it (data-dependent control flow) must still not leave the others in its gradient
    collectives: in the middle of the loop every rank refuses at once, naming both steps; on
    its last batch the rank contributes zero to that step, as a rank out of data does. A rank
    that evaluates alone in the loop is refused on every rank too, and under DeepSpeed a rank
    that skips the (collective) optimizer step; a rank whose forward raises midway leaves with
    its error and the others with PeerLeftJoinError."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_skip", strategy, timeout=90)
    assert result.returncode == 0, result.explain()
    rank0, rank1 = result.json()
    expected = (
        "RuntimeError: Inside lite.join the ranks still active announced different steps (rank 0: "
        "the backward of forward #4 of model 0; rank 1: forward #5 of model 0)"
    )
    # where a forward gathers nothing (DDP, ZeRO-1/2) a training forward has no round while
    # every rank runs: rank 1 is at its backward's
    lean = strategy in ("ddp", "deepspeed_stage_1", "deepspeed_stage_2")
    alone = (
        "RuntimeError: Inside lite.join the ranks still active announced different steps (rank 0: "
        "forward #5 of model 0 without gradients; rank 1: "
        + ("the backward of forward #5 of model 0)" if lean else "forward #5 of model 0)")
    )
    for rank in (rank0, rank1):
        assert rank["middle"]["error"].startswith(expected), rank["middle"]
        assert 'skip = lite.all_reduce(float(not ok), op="max") > 0' in rank["middle"]["error"], rank["middle"]
        assert "skip = " not in rank["eval"]["error"], rank["eval"]  # the same forward, one without gradients
        assert rank["eval"]["error"].startswith(alone) and rank["eval"]["after"] == 3.0, rank["eval"]
        assert rank["middle"]["after"] == 3.0  # the next collective pairs: 1 + 2
        assert rank["raises"]["after"] == 3.0, rank["raises"]
        assert rank["last"]["error"] is None and rank["last"]["after"] == 3.0
        if strategy.startswith("deepspeed"):  # the step skipped: both raise, none waits
            assert rank["step"]["after"] == 3.0, rank["step"]
    if strategy.startswith("deepspeed"):
        # rank 1 is refused; under ZeRO-1/2 at its next backward (its next forward has no round:
        # "backward twice before optimizer.step()"), which it leaves by, taking the step first
        assert rank1["step"]["error"].startswith("RuntimeError"), rank1["step"]
        left = "PeerLeftJoinError: Another rank left lite.join" if lean else "RuntimeError"
        assert rank0["step"]["error"].startswith(left), rank0["step"]
    for rank in (rank0, rank1):
        assert rank["save"]["after"] == 3.0, rank["save"]
    if strategy == "deepspeed_stage_3":  # state_dict() gathers there: refused before it does
        assert rank0["save"]["error"].startswith(
            "RuntimeError: Inside lite.join, Sequential.state_dict() needs the model's parameters gathered"
        ), rank0["save"]
        assert "Call it on every rank after the `with lite.join(...)` block." in rank0["save"]["error"]
        assert rank1["save"]["error"].startswith("PeerLeftJoinError: Another rank left lite.join"), rank1["save"]
    else:
        assert rank0["save"]["error"] is None and rank1["save"]["error"] is None, (rank0["save"], rank1["save"])
    assert rank1["raises"]["error"] == "KeyError: 'rank 1 fails inside its forward'", rank1["raises"]
    assert rank0["raises"]["error"].startswith("PeerLeftJoinError: Another rank left lite.join"), rank0["raises"]
    got = rank0["last"]["params"]
    assert got[0] == got[1], "the ranks' parameters differ"
    assert max_diff(_flat(got[0]), _flat(rank0["last"]["reference"])) < 1e-6


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2"])
def test_what_a_rank_does_on_its_own_last_batch_is_refused_at_once_or_exact(script, strategy):
    """Inside lite.join the ranks' last batches come at different steps. An accumulation
    window ended at each rank's own last batch (HF Accelerate's end-of-loader sync) and an
    end-of-epoch lite.all_reduce at `i == len(loader) - 1` are refused on every rank at once,
    naming the fix, over a set-up loader (whose last shared batch runs with rounds) and over a
    plain list (where the rank that skipped the sync takes part in the other's all-reduce
    first: DDP and ZeRO-1; ZeRO-2 reduces every backward). Before, each hung until the timeout
    or aborted. The fix the refusal names (windows by step count) trains as plain torch does,
    and so do ranks that peek at a batch and then leave their loops at the same batch."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_last_batch", strategy, timeout=120)
    assert result.returncode == 0, result.explain()
    ranks = result.json()
    for rank, got in enumerate(ranks):
        for case in ("window_ends_at_own_last", "window_ends_at_own_last_list"):
            error = got[case]["error"]
            assert error is not None and got[case]["after"] == 3.0, (rank, case, got[case])
            assert "rank 0: " in error and "inside no_backward_sync" in error, (rank, case, error)
            assert "End windows by the step count alone" in error, (rank, case, error)
        log = got["epoch_end_log"]
        assert log["after"] == 3.0 and log["error"] is not None, (rank, log)
        assert "lite.all_reduce(op='sum')" in log["error"] and "belongs after the loop" in log["error"], log
        for case in ("window_by_step", "window_by_step_forward_outside_list"):
            assert got[case]["error"] is None and got[case]["after"] == 3.0, (rank, case, got[case])
    # plain torch over the batches each rank saw: windows of 2 steps; rank 1's 5th batch, in an
    # open window when it ran out, counts in rank 0's last window; DDP's mean over 2 ranks
    seen = [got["window_by_step"]["batches"] for got in ranks]
    assert [len(s) for s in seen] == [6, 5], [len(s) for s in seen]
    assert [got["window_by_step_forward_outside_list"]["batches"] for got in ranks] == seen
    # DDP synchronises each backward whose forward ran outside no_sync: rank 1, out of data in
    # the last window, brings the window's average it holds to rank 0's last all-reduce (torch's
    # Join brings zero there, and the window's first micro-batches would count half)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in ((0, 1), (2, 3), (4, 5)):
        loss = sum(
            torch.nn.functional.mse_loss(model(torch.tensor(s[i][0])), torch.tensor(s[i][1]))
            for s in seen
            for i in window
            if i < len(s)
        )
        (loss / 2).backward()
        opt.step()
        opt.zero_grad()
    expected = _flat([p.detach().flatten().tolist() for p in model.parameters()])
    for rank, got in enumerate(ranks):
        for case in ("window_by_step", "window_by_step_forward_outside_list"):
            assert max_diff(_flat(got[case]["params"]), expected) < 1e-6, f"rank {rank}, {case}"
    # every rank left its loop after 3 batches: plain torch over those, one step each
    seen = [got["break_together"]["batches"] for got in ranks]
    assert [len(s) for s in seen] == [3, 3], [len(s) for s in seen]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        loss = sum(torch.nn.functional.mse_loss(model(torch.tensor(s[i][0])), torch.tensor(s[i][1])) for s in seen)
        (loss / 2).backward()
        opt.step()
        opt.zero_grad()
    expected = _flat([p.detach().flatten().tolist() for p in model.parameters()])
    for rank, got in enumerate(ranks):
        assert got["break_together"]["error"] is None and got["break_together"]["after"] == 3.0, got["break_together"]
        assert max_diff(_flat(got["break_together"]["params"]), expected) < 1e-6, f"rank {rank}, break_together"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_3"])
def test_lr_schedulers_are_mirrored_by_the_rank_out_of_data_however_they_are_built(script, strategy):
    """A warm-up + cosine ``SequentialLR`` and a ``ChainedScheduler`` (neither calls
    ``LRScheduler.__init__``) built in the run, and a ``StepLR`` built before ``lite.launch``
    and handed to ``lite.join``: the rank that ran out steps them as the other does, so the
    parameters and learning rate end equal on both ranks and equal to plain torch's. The same
    early scheduler not handed to the block is refused on every rank, naming the fix."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_schedulers", strategy, timeout=90)
    assert result.returncode == 0, result.explain()
    record = result.json()
    ranks, reference = record["ranks"], record["reference"]
    for case, (expected_params, expected_lr) in reference.items():
        for rank, got in enumerate(ranks):
            what = f"{case}, rank {rank}"
            assert got[case]["error"] is None and got[case]["after"] == 3.0, (what, got[case])
            assert got[case]["lr"] == pytest.approx(expected_lr, rel=1e-12), what
            assert max_diff(_flat(got[case]["params"]), _flat(expected_params)) < 1e-6, what
    assert all(lr != 0.1 for _, lr in reference.values()), reference  # each scheduler moved the LR from SGD's
    for rank, got in enumerate(ranks):
        unnamed = got["before_launch_unnamed"]
        assert unnamed["after"] == 3.0, unnamed  # the next collective pairs
        assert unnamed["error"] is not None, f"rank {rank}: not refused"
    refusal = ranks[0]["before_launch_unnamed"]["error"]
    assert refusal.startswith("RuntimeError: The learning rate of optimizer 0"), refusal
    assert "`lite.join(model, scheduler)`" in refusal, refusal


# (rounds per step, of them awaited) in the first two steps of a plain loop, then in each later step
ROUNDS = {"ddp": ((2, 1), (1, 0)), "fsdp": ((2, 2), (2, 1)), "deepspeed_stage_3": ((3, 2), (3, 1))}


@pytest.mark.parametrize("strategy", list(ROUNDS))
def test_the_protocol_rounds_on_even_data(script, strategy):
    """Counted where the session opens them (the strategies' own collectives are not): over a
    set-up loader one round when the pass begins and none per step. Over a plain list, from a
    model's third training step: under ddp one round per step, the backward's, not waited for
    (the forward has none: it gathers nothing); under fsdp and ZeRO-3 the forward's round,
    posted before its gathers, and the backward's, awaited (a rank whose forward raised midway
    could not answer it); under DeepSpeed also its collective step's, posted. The first two
    steps await their forwards' rounds (DDP rebuilds its buckets in the second). One round at
    the end, awaited."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("join_rounds", strategy, timeout=90)
    assert result.returncode == 0, result.explain()
    (first, first_awaited), (later, later_awaited) = ROUNDS[strategy]
    expected = {"2": 1, "5": 1, "awaited2": 1, "awaited5": 1}
    for n in (2, 5):
        expected[f"list{n}"] = 2 * first + (n - 2) * later + 1
        expected[f"awaited_list{n}"] = 2 * first_awaited + (n - 2) * later_awaited + 1
    for rank, counts in enumerate(result.json()):
        assert counts == expected, f"rank {rank}: rounds {counts}"
