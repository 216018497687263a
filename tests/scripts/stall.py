"""The hang watchdog under launch(timeout=300), on 3 ranks.

argv: mode
  stall: a short stall window set by the test (SCOPEDLITE_HANG_TIMEOUT), steps 1 and 2.
  sigterm: step 2 only, stall detection off (SCOPEDLITE_HANG_TIMEOUT=off); the test sends
    rank 0 a SIGTERM (as `timeout 120 python train.py` does) and a short grace
    (SCOPEDLITE_TERM_GRACE) ends the run.

1. Rank 0 works alone (in Python) for three stall windows while ranks 1 and 2 wait for it in
   lite.barrier(): no stall, the barrier passes.
2. Rank 1 skips an all_reduce that ranks 0 and 2 wait in, and goes to the end of the block:
   the watchdog ends the run, naming where every rank waits.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

import scopedlite as lite

OUT = os.environ["OUT"]
mode = sys.argv[1]
outcome: dict = {"barrier_passed": False, "error": None}
try:
    with lite.launch(strategy="ddp", devices=3, accelerator="cpu", timeout=300) as run:
        with open(f"{OUT}.pid{run.global_rank}", "w") as f:
            f.write(str(os.getpid()))
        if mode == "stall":
            if run.is_global_zero:
                time.sleep(3 * float(os.environ["SCOPEDLITE_HANG_TIMEOUT"]))  # legitimate work, rank 0 alone
            lite.barrier()
            outcome["barrier_passed"] = True
        if mode == "sigterm" and run.is_global_zero:
            Path(f"{OUT}.ready").touch()  # the test sends SIGTERM now
        if run.global_rank != 1:
            lite.all_reduce(torch.ones(2))  # rank 1 skipped it
except BaseException as e:  # noqa: BLE001 - report whatever came out
    outcome.update(error=type(e).__name__, message=str(e))
outcome["pids"] = [int(Path(f"{OUT}.pid{rank}").read_text()) for rank in range(3)]
with open(OUT, "w") as f:
    json.dump(outcome, f)
