"""A rank fails in one of several ways; rank 0 reports what it caught and how fast.

argv: mode rank [devices]
  mode: raise | kill | abort | busy (the failing rank raises while the others compute
        outside any collective) | exit (sys.exit(3)) | timeout (a rank skips a collective)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import scopedlite as lite

mode, who = sys.argv[1], int(sys.argv[2])
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 3
marks = Path(os.environ["OUT"] + ".marks")
marks.mkdir(exist_ok=True)

outcome = {}
try:
    with lite.launch(strategy="ddp", devices=devices, accelerator="cpu", timeout=4 if mode == "timeout" else 60) as run:
        (marks / f"pid{run.global_rank}").write_text(str(os.getpid()))
        lite.barrier()
        if run.global_rank == who:
            time.sleep(0.3)
            (marks / "fault").write_text(repr(time.time()))
            if mode in ("raise", "busy"):
                raise ValueError(f"boom on rank {run.global_rank}")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "abort":
                os.abort()
            if mode == "exit":
                sys.exit(3)
            if mode == "timeout":
                time.sleep(30)
        if mode == "busy":
            end = time.time() + 30
            while time.time() < end:
                sum(range(1000))
        else:
            lite.all_reduce(torch.ones(2))
            time.sleep(30)
    outcome["error"] = None
except BaseException as e:  # noqa: BLE001 - report whatever came out
    caught = time.time()
    fault = float((marks / "fault").read_text()) if (marks / "fault").exists() else None
    outcome = {
        "error": type(e).__name__,
        "message": str(e),
        "notes": getattr(e, "__notes__", []),
        "ranks": list(getattr(e, "ranks", ())),
        "latency": None if fault is None else caught - fault,
    }
outcome["pids"] = [int(p.read_text()) for p in marks.glob("pid*")]
with open(os.environ["OUT"], "w") as f:
    json.dump(outcome, f)
