"""A collective of ours on some ranks only, outside lite.join: refused at once through the
gather ledger (``_strategies/lockstep.py``), where the lone rank would otherwise meet the
others' gradient reduction or gathers (gloo aborts the process, NCCL hangs) or wait until the
timeout. The same ledger refuses a loop left on some ranks (at the end of the block) and a
state dict loaded on some ranks only. Real processes over gloo."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import max_diff

pytestmark = pytest.mark.timeout(120)
_AT_LINE = r" at \S*collective_on_some_ranks\.py:\d+"  # a rank's line in a refusal's table


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_collective_on_rank_zero_alone_is_refused_at_once(script, strategy):
    """``if rank == 0: lite.all_reduce(x)`` while training goes on with a logged all-reduce on
    every rank. Correct calls first: each value as plain arithmetic gives it. A collective
    written on two lines is refused on both ranks at once, naming each rank's line; so is a
    broadcast from two lines, with a different source rank on each (before: every rank sent,
    and gloo waited until the timeout), or meeting an all-reduce. A lone call through a
    helper, the same line as rank 1's next call of it (before: both got 100 + 2), is refused
    on both at once, told apart by the callers. A lone call from a line of its own meeting
    rank 1's all-reduce of the same shape (before: both got 100 + 2) is refused on both at
    once. The run ends in seconds, not with
    gloo's abort or at launch(timeout=60)."""
    result = script("collective_on_some_ranks", strategy, timeout=90)
    assert result.returncode == 1, result.explain()
    out = result.json()  # rank 0's values
    assert out["branches"] == [10.0, 10.0]  # 10 + 0, per-rank values passed on one line
    assert out["broadcast"] == "from rank 0"
    assert out["rows"] == [0, 0, 1]  # rank 0's one row, rank 1's two
    two_lines = out["two_lines"]
    assert two_lines.startswith("CollectiveMismatchError: The ranks called lite.all_reduce from different lines"), (
        two_lines
    )
    assert len(re.findall(_AT_LINE, two_lines)) == 2, two_lines  # each rank's line
    assert "rank 0: lite.all_reduce(op='sum') of float32[] at " in two_lines, two_lines
    assert "if run.is_global_zero:" in two_lines and "lite.all_reduce(a if rank == 0 else b)" in two_lines
    sources, lines = out["broadcast_src"], out["broadcast_lines"]
    assert sources.startswith("CollectiveMismatchError: The ranks called lite.broadcast with different source"), sources
    assert "rank 0: lite.broadcast(src=0) at " in sources and "rank 1: lite.broadcast(src=1) at " in sources, sources
    assert lines.startswith("CollectiveMismatchError: The ranks called lite.broadcast from different lines"), lines
    assert len(re.findall(_AT_LINE, lines)) == 2, lines
    kinds = out["kinds"]
    assert kinds.startswith("CollectiveMismatchError: The ranks called different collectives at the same point"), kinds
    assert "rank 0: lite.broadcast(src=0) at " in kinds and "rank 1: lite.all_reduce(op='sum') of float32[]" in kinds
    metrics = out["metrics_kinds"]
    assert metrics.startswith("CollectiveMismatchError: The ranks called different collectives at the same point"), (
        metrics
    )
    assert "rank 0: lite.gather_for_metrics of int64[3] at " in metrics, metrics
    assert "rank 1: lite.all_reduce(op='sum') of float32[] at " in metrics, metrics
    # the helper's lone call met rank 1's call of it: the same line, told apart by the callers
    helper = out["helper"]
    assert helper.startswith(
        "CollectiveMismatchError: The ranks called lite.all_reduce from the same line through different callers"
    ), helper
    assert helper.count("(from collective_on_some_ranks.py:") == 2, helper  # each rank's callers
    assert "reduce_mean(a if rank == 0 else b)" in helper, helper
    assert out["logged"] == [3.0, 3.0, 3.0]  # and the ranks went on in step
    # the last lone call, from a line of its own: both ranks refused at once, no value
    assert (
        "rank 0 raised CollectiveMismatchError: The ranks called lite.all_reduce from different lines"
        in (result.stderr)
        or "rank 1 raised CollectiveMismatchError: The ranks called lite.all_reduce" in result.stderr
    ), result.explain()
    assert "rank 1 got" not in result.stdout and "rank 0 got" not in result.stdout, result.explain()
    assert "the collective on rank 0 alone was not refused" not in result.stderr
    assert "EnforceNotMet" not in result.stderr and "CollectiveTimeoutError" not in result.stderr


@pytest.mark.parametrize("mode", ["stall", "backward"])
def test_a_rank_waiting_for_ranks_that_went_on_is_refused_not_left_to_the_watchdog(script, mode):
    """tests/scripts/stall.py with the order check on (test_watchdog.py runs it off, to test the
    watchdog on a desync it cannot see). ``stall``: rank 0 works alone for three stall windows
    while the others wait in lite.barrier(), which passes; then rank 1 skips an all-reduce
    and ends its block, and ranks 0 and 2 are refused at it. ``backward``: rank 0 alone calls
    lite.barrier() after a DDP step while the others go on to the next: rank 0 is refused,
    naming their training forward."""
    result = script("stall", mode, env={"SCOPEDLITE_HANG_TIMEOUT": "2"})
    out = result.json()
    # rank 0's own refusal, or under "stall" rank 2's, reported first
    assert out["error"] in ("CollectiveOnSomeRanksError", "WorkerFailedError"), result.explain()
    assert "CollectiveOnSomeRanksError" in out["error"] + out["message"], out["message"]
    if mode == "stall":
        assert out["barrier_passed"], result.explain()
        assert "lite.all_reduce() would wait for rank(s) [1]" in out["message"], out["message"]
        assert "rank 1 reached the end of its launch block" in out["message"], out["message"]
    else:
        assert "lite.barrier() would wait for rank(s) [1, 2]" in out["message"], out["message"]
        assert "rank 2 went on to training forward 3 (this rank has run 2)" in out["message"], out["message"]
    assert "if run.is_global_zero:" in out["message"]


_WENT_ON = "rank(s) [{other}] went on (rank {other} went on to training forward 4 (this rank has run 3))"


@pytest.mark.parametrize(
    ("strategy", "case"),
    [("ddp", "rank0"), ("ddp", "rank1"), ("fsdp", "rank0"), ("fsdp", "uneven"), ("deepspeed_stage_3", "rank0")],
)
def test_a_loop_left_on_some_ranks_is_refused_at_the_end_of_the_block(script, strategy, case):
    """An early stop decided on one rank (``if run.is_global_zero and ...: break``), or ranks
    with different numbers of batches outside lite.join: the rank that stops reaches the end
    of its block while the other runs a training forward it never runs, and waits in that
    step's collectives for it. Both waited until the hang watchdog ended the run (120 s by
    default, naming only where each rank waits), or launch(timeout=) with it off. Now the rank
    at the end reads the others' gather ledger lines while it waits (after 0.2 s) and raises,
    naming the rank, its forward and both fixes; the run ends."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("stop_on_some_ranks", strategy, case, timeout=100)
    assert result.returncode == 1, result.explain()
    stopper = 1 if case == "rank1" else 0
    went_on = _WENT_ON.format(other=1 - stopper)
    assert f"This rank reached the end of its launch block, but {went_on}" in result.stderr, result.explain()
    # rank 0 is the launching process; a worker's error is reported by it, the others stopped
    reported = "raised on rank 0 of 2" if stopper == 0 else "rank 1 raised ForwardOnSomeRanksError"
    assert reported in result.stderr, result.explain()
    assert f"under strategy='{strategy}'" in result.stderr, result.explain()
    for fix in ("with lite.join(model):", 'stop = lite.all_reduce(float(should_stop), op="max") > 0'):
        assert fix in result.stderr, result.explain()
    assert "Timed out" not in result.stderr, result.explain()


@pytest.mark.parametrize("case", ["rank1", "correct"])
def test_under_torchrun_a_loop_left_on_some_ranks_is_refused_and_a_late_rank_is_not(run_python, case):
    """The same script under torchrun (a world someone else started): there the ranks meet at
    the end of the block through the agent's store (``meet_at_block_end``), and the first rank
    to arrive reads the others' ledger lines. ``rank1``: rank 1 stops early under fsdp and is
    refused (before, the hang watchdog ended the job after 120 s, naming only where each rank
    waited); its exit ends the job under torchrun's agent. ``correct``: rank 1 reaches the end
    2.5 s after rank 0 evaluated alone: the job ends well."""
    strategy = "fsdp" if case == "rank1" else "ddp"
    script = Path(__file__).parent / "scripts" / "stop_on_some_ranks.py"
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    result = run_python(*torchrun, str(script), strategy, case, timeout=100)
    if case == "correct":
        assert result.returncode == 0, result.explain()
        assert "rank 1 reaches the end late" in result.stdout + result.stderr, result.explain()
        return
    assert result.returncode != 0, result.explain()
    assert f"This rank reached the end of its launch block, but {_WENT_ON.format(other=0)}" in result.stderr, (
        result.explain()
    )
    assert "No rank moved for" not in result.stderr, result.explain()  # not the hang watchdog


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_arriving_late_at_the_end_is_not_refused(script, strategy):
    """Every rank runs the same steps; then rank 0 evaluates alone under torch.no_grad() (ddp)
    and rank 1 reaches the end of its block 2.5 s after rank 0, whose reads of the ledger at
    the end see it working on: the run ends well."""
    result = script("stop_on_some_ranks", strategy, "correct", timeout=100)
    assert result.returncode == 0, result.explain()
    assert "rank 1 reaches the end late" in result.stdout + result.stderr, result.explain()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_2"])
def test_a_state_dict_loaded_on_some_ranks_only_is_refused(script, strategy):
    """``if run.is_global_zero: model.load_state_dict(...)`` (or the optimizer's) after
    lite.setup: nothing sends the values to the other ranks. Under ddp rank 0's replica alone
    took them and the replicas parted (0.9 apart in this script); under ZeRO-2 rank 0's
    partition of the master weights, a mix; under fsdp rank 0's shards. Now refused on rank 0
    before anything is loaded, naming rank 1's forward and the fix; the run trains on as plain
    torch does. Loads on every rank of a plain torch run's state dicts (the model's; under ddp
    and fsdp the optimizer's too, each rank taking its shard under fsdp) pass and train as
    plain torch; under ZeRO-2 the plain optimizer's is refused, naming lite.load."""
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install scopedlite[deepspeed])")
    result = script("load_on_some_ranks", strategy, timeout=100)
    assert result.returncode == 0, result.explain()
    ranks = result.json()
    for rank in ranks:
        plain = rank["plain_optimizer"]
        if strategy.startswith("deepspeed"):  # a plain optimizer's state, on every rank: refused, naming lite.load
            assert plain is not None and plain.startswith(
                "optimizer.load_state_dict() got the state of an optimizer"
            ), plain
            assert 'lite.load(path, {"model": model, "opt": opt})' in plain, plain
        else:
            assert plain is None, plain
    refused = ranks[0]["refused"]
    assert set(refused) == ({"model"} if strategy.startswith("deepspeed") else {"model", "optimizer"}), refused
    for what, error in refused.items():
        assert error is not None, f"{what}: loaded on rank 0 alone without a word"
        assert "load_state_dict() was called on rank(s) [0] only (rank 1 went on to the model's forward)" in error
        assert "alone it would change that rank's copy only" in error, error
        assert "lite.load(path" in error, error
    assert ranks[1]["refused"] == {}
    for rank, out in enumerate(ranks):
        assert max_diff(out["trained"], out["reference"]) < 1e-6, f"rank {rank}"
