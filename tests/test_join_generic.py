"""torch's generic Join tests (test/distributed/algorithms/test_join.py), ported to lite.join.

One launch per strategy of tests/scripts/join_generic.py (ddp on 3 ranks, fsdp on 2), shared by
every test here. Rank r has ``BASE + r * OFFSET`` inputs; every expected value is computed here
from those counts, the models' state by plain torch in one process (``reference_train``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_warm

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import assert_close
from _torch_models import reference_train

pytestmark = pytest.mark.timeout(150)

BASE, OFFSET = 3, 1  # torch's base_num_inputs and offset
BEFORE, AFTER = 41, 42  # torch's BEFORE_CONSTANT and AFTER_CONSTANT
MODELS = [("mlp", "adamw"), ("bn_mlp", "sgd")]  # the script's two models in one block
PEER_LEFT = "PeerLeftJoinError: Another rank left lite.join by an exception"


@pytest.fixture(scope="module", params=[("ddp", 3), ("fsdp", 2)], ids=lambda p: f"{p[0]}-{p[1]}")
def generic(request, tmp_path_factory):
    """(strategy, world size, every rank's records) of one launch."""
    strategy, world = request.param
    folder = tmp_path_factory.mktemp(f"join-generic-{strategy}")
    result = run_warm(SCRIPTS / "join_generic.py", strategy, str(world), tmp_path=folder, timeout=140)
    assert result.returncode == 0, result.explain()
    ranks = result.json()
    assert len(ranks) == world
    return strategy, world, ranks


def _inputs(world: int) -> list[int]:
    return [BASE + r * OFFSET for r in range(world)]


def _running(world: int, rank: int) -> int:
    """torch's expected_total for one all-reduce of a one per iteration: over this rank's
    iterations, how many ranks still had an input."""
    n = _inputs(world)
    return sum(sum(1 for count in n if count > i) for i in range(n[rank]))


def test_all_reduces_of_ones_count_the_ranks_still_iterating(generic):
    """test_single_joinable_main_hooks and test_join_kwargs (num_allreduces=2): a rank that has
    run out adds nothing, over a plain list (a round every step) and over a set-up loader."""
    _, world, ranks = generic
    assert _running(world, 0) == world * BASE  # every rank iterates while rank 0 does
    for rank, record in enumerate(ranks):
        for source in ("list", "loader"):
            for per_iteration in (1, 2):
                got = record["main"][f"{source}:{per_iteration}"]
                assert got["done"] == _inputs(world)[rank], (rank, source)
                assert got["total"] == per_iteration * _running(world, rank), (rank, source, per_iteration)


def test_post_work_sees_every_rank_once_all_have_joined(generic):
    """test_single_joinable_post_hooks: no collective in the loop, then the last joiner found
    from every rank's count broadcasts AFTER; the others held BEFORE. Inside the block after the
    loop over a set-up loader (it waits for the others there), after the block over a list."""
    _, world, ranks = generic
    for rank, record in enumerate(ranks):
        for source in ("loader", "list"):
            got = record["post"][source]
            assert got["done"] == _inputs(world)[rank], (rank, source)
            assert got["counts"] == _inputs(world), (rank, source)
            assert got["value"] == AFTER, (rank, source)


def test_two_models_in_one_join_train_like_one_process(generic):
    """test_multiple_joinables: two set-up models in one block, an all-reduce of a one per
    model per iteration (twice the single total), the post work per model, and each model's
    state after the block as plain torch computes it (parameters on every rank; buffers the last
    joiner's under ddp, each rank's own under fsdp; ddp: each rank's optimizer state)."""
    strategy, world, ranks = generic
    n = _inputs(world)
    expected = [
        reference_train(
            {
                "model": kind,
                "window": 1,
                "mapping": dict(enumerate(n)),
                "divide": True,
                "clip": "",
                "optimizer": optimizer,
            },
            world,
            ddp=strategy == "ddp",
        )
        for kind, optimizer in MODELS
    ]
    for rank, record in enumerate(ranks):
        got = record["multiple"]
        assert got["done"] == n[rank] and got["total"] == len(MODELS) * _running(world, rank), rank
        assert got["posts"] == [[n, AFTER + j] for j in range(len(MODELS))], rank
        for j, (kind, _) in enumerate(MODELS):
            mine, want = got["models"][j], expected[j][rank]
            what = f"rank {rank}'s {kind}"
            assert_close(mine["params"], want["params"], 1e-5, f"{what} parameters")
            if want["buffers"]:
                assert_close(mine["buffers"], want["buffers"], 1e-5, f"{what} buffers")
            else:
                assert mine["buffers"] == [], what
            assert mine["lr"] == pytest.approx(want["lr"], rel=1e-12), what  # each StepLR mirrored
            if strategy == "ddp":
                assert_close(mine["moments"], want["moments"], 1e-5, f"{what} optimizer state")


def test_a_rank_raising_when_it_runs_out_makes_the_others_raise_in_step(generic):
    """test_single_joinable_throw / test_multiple_joinables_throw: rank 0 (the fewest inputs)
    raises "Rank 0 exhausted all inputs." when it runs out, inside a block over two models; the
    others raise PeerLeftJoinError at their next collective, the iteration it did not start,
    and the next collective after the block pairs every rank (1 + ... + world)."""
    _, world, ranks = generic
    first = min(_inputs(world))
    for rank, record in enumerate(ranks):
        got = record["throw"]
        if rank == 0:
            assert got["error"] == "RuntimeError: Rank 0 exhausted all inputs.", got
        else:
            assert got["error"].startswith(PEER_LEFT), (rank, got)
        assert got["done"] == first and got["total"] == len(MODELS) * world * first, (rank, got)
        assert got["after"] == world * (world + 1) / 2, (rank, got)


def test_throw_on_early_termination_written_with_lite_collectives(generic):
    """throw_on_early_termination by hand inside the block: each iteration all-reduces (max)
    whether a rank has run out; every rank raises its own error at the same iteration (none
    is taken for a peer's), and the ranks stay in step after the block."""
    _, world, ranks = generic
    first = min(_inputs(world))
    for rank, record in enumerate(ranks):
        got = record["throw_by_hand"]
        if _inputs(world)[rank] == first:
            assert got["error"] == f"RuntimeError: Rank {rank} exhausted all inputs.", (rank, got)
        else:
            assert got["error"] == (
                "RuntimeError: Detected at least one rank that exhausted inputs. Throwing across all ranks."
            ), (rank, got)
        assert got["done"] == first and got["total"] == len(MODELS) * world * first, (rank, got)
        assert got["after"] == world * (world + 1) / 2, (rank, got)
