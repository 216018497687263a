"""The hang watchdog (scopedlite/_launch/watchdog.py, stall.py): a desync the library cannot
foresee ends the run with where every rank waits, long before the collective timeout; a rank
working alone never does; a SIGTERM ends a run stuck in a collective after a grace period.

The first tests look at real frames of a real thread, whose code is compiled under the file
names of the places they stand for; the last ones run real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import SCRIPTS, _env
from scopedlite._hardware.machine import Machine
from scopedlite._launch.stall import DTENSOR_WAIT, LEDGER_WAIT, WRITTEN_BYTES, Look, Progress, look_at
from scopedlite._launch.watchdog import Limits
from scopedlite._plan import resolve

SITE = "/venv/lib/python3.11/site-packages"
USER = "/home/me/train.py"


def _stack_of(chain: list[tuple[str, str]]) -> tuple[Look, threading.Lock, threading.Thread]:
    """Run a thread through functions named and filed as ``chain`` (outermost first), the
    innermost one blocked in C (a lock, as a collective blocks in C++), and look at it there."""
    gate, there = threading.Lock(), threading.Event()
    gate.acquire()
    namespace: dict = {"gate": gate, "there": there}
    inner = "there.set(); gate.acquire()"
    for level, (name, filename) in reversed(list(enumerate(chain))):
        code = f"def {name}():\n    {inner}\n"
        exec(compile(code, filename, "exec"), namespace)  # a frame filed under that name
        namespace[f"level{level}"] = namespace.pop(name)
        inner = f"level{level}()"
    thread = threading.Thread(target=namespace["level0"], daemon=True)
    thread.start()
    assert there.wait(10)
    look = look_at(sys._current_frames()[thread.ident])
    return look, gate, thread


def _look(chain: list[tuple[str, str]]) -> Look:
    look, gate, thread = _stack_of(chain)
    gate.release()
    thread.join()
    return look


def test_a_collective_is_a_wait_named_with_the_users_line():
    look = _look(
        [
            ("main", USER),
            ("all_reduce", "/repo/scopedlite/_api/collectives.py"),
            ("all_reduce_tensor", "/repo/scopedlite/_comm/distributed.py"),
            ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py"),
            ("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py"),
        ]
    )
    assert look.waiting
    assert look.where == "all_reduce (train.py:2)"


def test_the_end_of_the_block_and_a_passing_check_are_a_wait():
    look = _look(
        [
            ("main", USER),
            ("final_barrier", "/repo/scopedlite/_launch/role.py"),
            ("end_of_block_barrier", "/repo/scopedlite/_comm/distributed.py"),
            ("raise_if_failed", "/repo/scopedlite/_launch/supervise.py"),  # rank 0 asks at every poll
        ]
    )
    assert look.where == "the end of the launch block (train.py:2)"


def test_a_dtensor_collective_is_a_wait_named_as_such():
    """float() of a norm of FSDP's sharded parameters on one rank alone: the rank waits in a
    functional collective's wait_tensor, whose innermost frame is torch's op wrapper (it was
    taken for work, and the run hung for the collective timeout)."""
    look = _look(
        [
            ("main", USER),
            ("_dispatch_get_local_results_slow_path", f"{SITE}/torch/distributed/tensor/_dispatch.py"),
            ("redistribute_local_tensor", f"{SITE}/torch/distributed/tensor/_redistribute.py"),
            ("wait", f"{SITE}/torch/distributed/_functional_collectives.py"),
            ("wait_tensor", f"{SITE}/torch/distributed/_functional_collectives.py"),
            ("__call__", f"{SITE}/torch/_ops.py"),
        ]
    )
    assert look.where == f"{DTENSOR_WAIT} (train.py:2)"


def test_the_gather_ledgers_check_is_one_wait_whether_it_reads_or_pauses():
    """A rank checking that every rank reaches its step (lockstep.py) polls the store: its
    innermost frame is the read of the others' lines, or the poll itself between two reads.
    Both are the same wait, in one place, named with the user's line (it was work before,
    and a rank the ledger could not see left the run hanging until the collective timeout)."""
    ledger = "/repo/scopedlite/_strategies/lockstep.py"
    above = [("main", USER), ("clip_gradients", "/repo/scopedlite/_api/setup.py"), ("_together", ledger)]
    reading = _look([*above, ("_poll", ledger), ("_entries", ledger)])
    pausing = _look([*above, ("_poll", ledger)])
    assert reading.where == pausing.where == f"{LEDGER_WAIT} (train.py:2)"
    assert reading.place == pausing.place
    assert not _look([*above, ("_write", ledger)]).waiting  # a write waits for no rank


@pytest.mark.parametrize(
    "chain",
    [
        # an op the user's code calls through torch.ops: work
        [("main", USER), ("__call__", f"{SITE}/torch/_ops.py")],
        # torchrun's @record wraps the whole program in a torch.distributed frame
        [("wrapper", f"{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py"), ("main", USER)],
        # a long backward: C++ under torch.autograd
        [("main", USER), ("backward", f"{SITE}/torch/autograd/__init__.py")],
        # rank 0 alone writing a checkpoint
        [("main", USER), ("save", "/repo/scopedlite/_api/checkpoint.py"), ("save", f"{SITE}/torch/serialization.py")],
    ],
    ids=["torch-op", "torchrun-record", "backward", "save"],
)
def test_work_is_not_a_wait(chain):
    assert not _look(chain).waiting


def test_a_backward_is_a_wait_only_while_the_process_uses_no_cpu():
    """DDP's gradient all-reduce is waited for inside torch's autograd engine (C++), its bucket
    rebuild inside its forward: a rank there is waiting while its process stands still, and
    working while it computes."""
    look = _look(
        [
            ("main", USER),
            ("backward", "/repo/scopedlite/_api/setup.py"),
            ("backward", f"{SITE}/torch/autograd/__init__.py"),
            ("_engine_run_backward", f"{SITE}/torch/autograd/graph.py"),
        ]
    )
    assert look.waiting and look.idle_only
    assert look.where == "a backward's gradient collectives (train.py:2)"
    rebuild = _look(
        [
            ("main", USER),
            ("forward", "/repo/scopedlite/_strategies/user_model.py"),
            ("_pre_forward", f"{SITE}/torch/nn/parallel/distributed.py"),
        ]
    )
    assert rebuild.idle_only and rebuild.where == "DistributedDataParallel's forward collectives (train.py:2)"
    clocks = {"cpu": 0.0, "wall": 0.0}
    progress = Progress(lambda: (1, 1), lambda: 0, lambda: (clocks["cpu"], clocks["wall"]))
    first = progress.update(look)
    clocks["wall"] += 2.0
    clocks["cpu"] += 0.01  # the watchdog's own look: standing still
    assert progress.update(look) == first
    clocks["wall"] += 2.0
    clocks["cpu"] += 1.5  # computing the backward
    assert progress.update(look) == first + 1
    clocks["wall"] += 2.0
    assert progress.update(_waiting()) == first + 2  # a plain collective needs no clock
    clocks["wall"] += 2.0
    clocks["cpu"] += 2.0  # gloo's own threads may spin: a collective stays one wait
    assert progress.update(_waiting()) == first + 2


def _waiting(place: int = 1) -> Look:
    return Look("all_reduce (train.py:2)", ("distributed_c10d.py", place))


def test_a_wait_is_one_episode_only_while_nothing_moves():
    counts = {"numbers": (5, 2), "written": 1000}
    progress = Progress(lambda: counts["numbers"], lambda: counts["written"])
    first = progress.update(_waiting())
    assert progress.update(_waiting()) == first  # standing still
    counts["written"] += WRITTEN_BYTES // 2  # a few bytes (a log line) is no transfer
    assert progress.update(_waiting()) == first
    counts["numbers"] = (6, 2)  # a loop of short collectives, each look landing in one
    assert progress.update(_waiting()) == first + 1
    counts["written"] += 2 * WRITTEN_BYTES  # a long transfer
    assert progress.update(_waiting()) == first + 2
    assert progress.update(_waiting(place=9)) == first + 3  # another wait
    assert progress.update(Look(None, (USER, 3))) == first + 4  # working
    assert progress.update(_waiting()) == first + 5  # a new wait
    assert progress.update(_waiting()) == first + 5


def test_without_a_count_of_collectives_every_look_is_progress():
    progress = Progress(lambda: None, lambda: None)
    assert progress.update(_waiting()) != progress.update(_waiting())


def test_a_sigterm_shortens_the_window_to_the_grace():
    assert Limits(120.0, 30.0).window(stopping=False) == 120.0
    assert Limits(120.0, 30.0).window(stopping=True) == 30.0
    assert Limits(None, 30.0).window(stopping=False) is None
    assert Limits(None, 30.0).window(stopping=True) == 30.0
    assert Limits(10.0, 30.0).window(stopping=True) == 10.0
    assert Limits(120.0, 30.0).interval == 2.0
    assert Limits(2.0, None).interval == 0.5


def _plan(env):
    return resolve(strategy="ddp", devices=2, accelerator="cpu", env=env, machine=Machine(cpu_count=4))


def test_the_limits_come_from_the_environment():
    assert (_plan({}).hang_timeout, _plan({}).term_grace) == (120.0, 30.0)
    plan = _plan({"SCOPEDLITE_HANG_TIMEOUT": "3", "SCOPEDLITE_TERM_GRACE": "off"})
    assert (plan.hang_timeout, plan.term_grace) == (3.0, None)
    assert _plan({"SCOPEDLITE_HANG_TIMEOUT": "0"}).hang_timeout is None
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ValueError, match=f"SCOPEDLITE_HANG_TIMEOUT='{bad}' is not valid.*0/off"):
            _plan({"SCOPEDLITE_HANG_TIMEOUT": bad})


# -- real processes ----------------------------------------------------------------------------


def _line_of(text: str) -> int:
    return 1 + next(i for i, line in enumerate((SCRIPTS / "stall.py").read_text().splitlines()) if text in line)


def _assert_where_every_rank_waits(message: str) -> None:
    collective = _line_of("lite.all_reduce(torch.ones(2))")
    assert f"rank 0: waits in all_reduce (stall.py:{collective})" in message, message
    assert "rank 1: waits in the end of the launch block (stall.py:" in message, message
    assert f"rank 2: waits in all_reduce (stall.py:{collective})" in message, message
    # and every rank's stack, as a collective timeout gives them
    assert f'stall.py", line {collective}' in message.split("--- rank 0 ---")[1]
    assert "--- rank 1 (done with the block's body" in message
    assert f'stall.py", line {collective}' in message.split("--- rank 2 ---")[1]


def _assert_no_survivors(pids: list[int]) -> None:
    assert len(pids) == 3
    for pid in pids:
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"process {pid} survived"


@pytest.mark.timeout(90)
def test_a_desync_is_ended_by_the_watchdog_not_the_collective_timeout(script):
    """Under launch(timeout=300): only the watchdog (window 2 s) can end it within the test's
    limit, and its report says so. Before that, rank 0 worked alone for three windows while
    the others waited in lite.barrier(): that passed."""
    result = script("stall", "stall", env={"SCOPEDLITE_HANG_TIMEOUT": "2", "SCOPEDLITE_ORDER_CHECK": "0"})
    out = result.json()
    assert out["barrier_passed"], result.explain()
    assert out["error"] == "CollectiveTimeoutError", result.explain()
    assert "every rank waits for the others (stall window 2 s, SCOPEDLITE_HANG_TIMEOUT)" in out["message"]
    _assert_where_every_rank_waits(out["message"])
    _assert_no_survivors(out["pids"])


@pytest.mark.timeout(90)
def test_a_rank_alone_in_a_collective_while_the_others_are_in_ddps_backward_is_ended(script):
    """Rank 0 alone in lite.barrier() after a step; ranks 1 and 2 in the next step's backward,
    waiting in DDP's gradient all-reduce inside torch's autograd engine. Under
    launch(timeout=300) only the watchdog (window 2 s) ends it within the test's limit."""
    _ended_with_rank_zero_alone(
        script, "backward", f"barrier (stall.py:{_line_of('lite.barrier()  # rank 0 alone')})", "torch.ones(2, 4)"
    )


@pytest.mark.timeout(90)
def test_a_rank_leaving_its_join_loop_early_alone_is_named_with_the_fix(script):
    """Inside lite.join over a set-up loader of even data (no round per step), rank 0 alone
    breaks out of its loop. Before, its final broadcast met the others' gradient all-reduce;
    now it waits in a round at the end of the block, which the watchdog names, with the fix."""
    block = _line_of("with lite.join(model):")
    message = _ended_with_rank_zero_alone(
        script, "break", f"lite.join's round at the end of its block (stall.py:{block})", "x"
    )
    assert "lite.all_reduce(torch.tensor(float(stop)), op='max')" in message, message


@pytest.mark.timeout(90)
def test_a_rank_alone_in_a_dtensor_collective_is_ended(script):
    """Under FSDP, rank 0 alone reads a norm of the sharded parameters while ranks 1 and 2
    wait in a raw torch.distributed.barrier(), where the gather ledger cannot see them: rank 0
    waits in the ledger's check before the DTensor's collective, and the watchdog names it."""
    result = script("stall", "dtensor", env={"SCOPEDLITE_HANG_TIMEOUT": "2", "SCOPEDLITE_ORDER_CHECK": "0"})
    out = result.json()
    assert out["error"] == "CollectiveTimeoutError", result.explain()
    message = out["message"]
    alone = _line_of("print(float(sum(p.detach().pow(2).sum()")
    assert f"rank 0: waits in {LEDGER_WAIT} (stall.py:{alone})" in message, message
    for rank in (1, 2):
        assert f"rank {rank}: waits in barrier (stall.py:{alone + 1})" in message, message
    _assert_no_survivors(out["pids"])


def _ended_with_rank_zero_alone(script, mode, rank_zero_waits_in, batch):
    """Run stall.py's ``mode`` (window 2 s): the watchdog must end it, naming rank 0's wait
    and ranks 1 and 2 in the backward of ``model(BATCH)``; its message."""
    result = script("stall", mode, env={"SCOPEDLITE_HANG_TIMEOUT": "2", "SCOPEDLITE_ORDER_CHECK": "0"})
    out = result.json()
    assert out["error"] == "CollectiveTimeoutError", result.explain()
    message = out["message"]
    backward = _line_of(f"lite.backward(model({batch}).sum())")
    assert f"rank 0: waits in {rank_zero_waits_in}" in message, message
    for rank in (1, 2):
        assert f"rank {rank}: waits in a backward's gradient collectives (stall.py:{backward})" in message, message
    _assert_no_survivors(out["pids"])
    return message


@pytest.mark.timeout(90)
def test_sigterm_ends_a_run_stuck_in_a_collective(tmp_path):
    """`timeout 120 python train.py` on a hung run: SIGTERM reaches rank 0 alone, whose main
    thread is blocked in gloo and cannot run a Python handler. Stall detection is off here:
    the grace after the SIGTERM (3 s) ends it, with every rank's place and stack."""
    out = tmp_path / "sigterm.json"
    env = {
        **_env(),
        "OUT": str(out),
        "SCOPEDLITE_HANG_TIMEOUT": "off",
        "SCOPEDLITE_TERM_GRACE": "3",
        "SCOPEDLITE_ORDER_CHECK": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "stall.py"), "sigterm"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{out}.ready") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]:
            os.kill(pid, signal.SIGKILL)
        raise
    assert out.exists(), f"exit {proc.returncode}\n{stderr}"
    result = json.loads(out.read_text())
    assert result["error"] == "CollectiveTimeoutError", stderr
    assert "A SIGTERM asked the run to stop, but it cannot reach a stop" in result["message"]
    assert "grace after a SIGTERM: 3 s, SCOPEDLITE_TERM_GRACE" in result["message"]
    _assert_where_every_rank_waits(result["message"])
    _assert_no_survivors(result["pids"])
