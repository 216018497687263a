"""lite.join on real gloo processes: uneven shards, collectives anywhere, no_grad eval.

Each case runs tests/scripts/join_run.py and checks what every rank saw and computed
against a single-process replay of the same data and sharding.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import batches, make_data, reference_training, shards  # noqa: E402

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
