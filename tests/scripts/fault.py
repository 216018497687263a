"""Fault injection: one rank fails in one way at one point; rank 0 reports what it caught.

argv: rank mode point
  mode:  raise | kill (SIGKILL) | abort (SIGABRT) | sigterm (two SIGTERMs: a forced stop) |
         kill_loader (SIGKILL of a rank whose DataLoader workers are running) |
         exit0 (sys.exit(0): the rank leaves the block early) |
         skip (the rank skips the last all_reduce and goes to the end of the block)
  point: init (right after launch) | entry (while rank 0 is still entering the launch block,
         its group made: its MetricLog is slowed until the failure is found) | forward (inside the model's forward) |
         collective (the others wait in an all_reduce) | save (while rank 0 saves) |
         join (inside lite.join over a set-up loader of even data, where the ranks run free:
         the others wait in the next step's gradient all-reduce)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch

import scopedlite as lite

rank_to_fail, mode, point = int(sys.argv[1]), sys.argv[2], sys.argv[3]
TIMEOUT = 2 if mode == "skip" else 30  # a skipped collective is found by the timeout
# With 2 ranks, only the killed rank's sockets can end rank 0's wait in a collective (with 3, the
# third rank's, closed when it is stopped, would hide a rank whose sockets stay open).
DEVICES = 2 if mode == "kill_loader" else 3
marks = Path(os.environ["OUT"] + ".marks")
marks.mkdir(exist_ok=True)


def fail() -> None:
    (marks / "fault").write_text(repr(time.time()))
    if mode == "raise":
        raise RuntimeError(f"injected fault on rank {lite.current().global_rank} at {point}")
    if mode in ("kill", "kill_loader"):
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit0":
        sys.exit(0)
    if mode == "abort":
        os.abort()
    if mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


if point == "entry":  # rank 0 (the one that writes metrics) sits in launch's entry until the fault
    import scopedlite._loggers.base as loggers

    plain_init = loggers.MetricLog.__init__

    def slow_init(self, loggers, write):
        if write:
            (marks / "entering").write_text("")
            deadline = time.time() + 10
            while time.time() < deadline and not (marks / "fault").exists():
                time.sleep(0.01)
            time.sleep(0.5)  # the supervisor polls every 50 ms
        plain_init(self, loggers, write)

    loggers.MetricLog.__init__ = slow_init

outcome = {}
try:
    with lite.launch(strategy="ddp", devices=DEVICES, accelerator="cpu", timeout=TIMEOUT) as run:
        me = run.global_rank
        # written whole or not at all: a rank stopped while writing left an empty file, which
        # rank 0 then failed to read (and wrote no outcome)
        (marks / f".pid{me}").write_text(str(os.getpid()))
        (marks / f".pid{me}").replace(marks / f"pid{me}")
        if mode == "kill_loader" and me == rank_to_fail:  # its DataLoader workers hold its sockets
            batches = iter(torch.utils.data.DataLoader(torch.arange(64.0), batch_size=8, num_workers=2))
            next(batches)
            for child in psutil.Process().children():
                (marks / f"pid{me}-loader{child.pid}").write_text(str(child.pid))
        if point == "init" and me == rank_to_fail:
            fail()
        if point == "entry" and me == rank_to_fail:
            while not (marks / "entering").exists():
                time.sleep(0.01)
            fail()
        model = lite.setup(torch.nn.Linear(4, 1))
        if point == "forward" and me == rank_to_fail:
            model.register_forward_pre_hook(lambda *_: fail())
        for step in range(3):
            loss = model(torch.randn(8, 4)).sum()
            lite.backward(loss)
            if point == "collective":
                if mode == "skip" and me == rank_to_fail and step == 2:
                    (marks / "fault").write_text(repr(time.time()))
                    break  # the others wait for it in this all_reduce
                if me == rank_to_fail and step == 1:
                    time.sleep(0.2)
                    fail()
                lite.all_reduce(loss.detach())
        if point == "join":
            data = torch.utils.data.TensorDataset(torch.randn(48, 4))
            loader = lite.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=4))
            with lite.join(model):
                for step, (x,) in enumerate(loader):
                    lite.backward(model(x).sum())
                    if me == rank_to_fail and step == 1:
                        fail()  # the exception leaves the loader's pass early: no round may follow
        if point == "save":
            if me == rank_to_fail:
                fail()
            lite.save(os.environ["OUT"] + ".ckpt", {"model": model})
        if mode != "skip" or me != rank_to_fail:
            time.sleep(TIMEOUT)  # a run that survives the fault idles here: a miss takes >= TIMEOUT
    outcome["error"] = None
except BaseException as e:  # noqa: BLE001 - report whatever came out
    caught = time.time()
    fault = float((marks / "fault").read_text()) if (marks / "fault").exists() else None
    outcome = {
        "error": type(e).__name__,
        "message": str(e),
        "ranks": list(getattr(e, "ranks", ())),
        "latency": None if fault is None else caught - fault,
    }
outcome["pids"] = [int(p.read_text()) for p in marks.glob("pid*")]
outcome["timeout"] = TIMEOUT
with open(os.environ["OUT"], "w") as f:
    json.dump(outcome, f)
