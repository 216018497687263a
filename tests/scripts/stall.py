"""The hang watchdog under launch(timeout=300), on 3 ranks.

argv: mode
  stall: a short stall window set by the test (SCOPEDLITE_HANG_TIMEOUT), steps 1 and 2.
  sigterm: step 2 only, stall detection off (SCOPEDLITE_HANG_TIMEOUT=off); the test sends
    rank 0 a SIGTERM (as `timeout 120 python train.py` does) and a short grace
    (SCOPEDLITE_TERM_GRACE) ends the run.
  backward: step 3 only, with the short stall window.
  break: step 4 only, with the short stall window.
  dtensor: step 5 only (under fsdp), with the short stall window.

1. Rank 0 works alone (in Python) for three stall windows while ranks 1 and 2 wait for it in
   lite.barrier(): no stall, the barrier passes.
2. Rank 1 skips an all_reduce that ranks 0 and 2 wait in, and goes to the end of the block:
   the watchdog ends the run, naming where every rank waits.
3. DDP training: after a step, rank 0 alone calls lite.barrier() (as a misplaced
   `if rank == 0:` block does) while ranks 1 and 2 go on to the next step, whose backward
   waits for rank 0 in DDP's gradient all-reduce, inside torch's autograd engine: the
   watchdog ends the run (it took the backward for work and waited out the collective
   timeout before).
4. DDP training inside lite.join over a set-up loader (even data: the ranks run free, with
   no round per step): rank 0 alone leaves its loop early (an early stop decided from its own
   numbers). It waits in a round at the end of the block, not in the final broadcast, which
   met the others' gradient all-reduce; the watchdog names that wait and the fix.
5. FSDP: rank 0 alone reads the squared norm of the sharded parameters (a log line under
   `if rank == 0:`), a DTensor reduction over every rank, while ranks 1 and 2 wait in a raw
   torch.distributed.barrier(). Its check against the others' steps (the gather ledger,
   which refuses it at once where the others wait in a call of ours: test_whole_numbers.py)
   cannot see them there and waits: the watchdog names that wait (it took the ledger's poll
   for work, and the run hung until the collective timeout, SIGTERM included).
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
    strategy = "fsdp" if mode == "dtensor" else "ddp"
    with lite.launch(strategy=strategy, devices=3, accelerator="cpu", timeout=300) as run:
        with open(f"{OUT}.pid{run.global_rank}", "w") as f:
            f.write(str(os.getpid()))
        if mode == "stall":
            if run.is_global_zero:
                time.sleep(3 * float(os.environ["SCOPEDLITE_HANG_TIMEOUT"]))  # legitimate work, rank 0 alone
            lite.barrier()
            outcome["barrier_passed"] = True
        if mode == "backward":
            model = lite.setup(torch.nn.Linear(4, 1))
            for step in range(3):
                lite.backward(model(torch.ones(2, 4)).sum())
                if step == 1 and run.is_global_zero:  # after DDP's bucket rebuild (2nd forward)
                    lite.barrier()  # rank 0 alone
        if mode == "break":
            model = lite.setup(torch.nn.Linear(4, 1))
            data = torch.utils.data.TensorDataset(torch.ones(24, 4))
            loader = lite.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=2))
            with lite.join(model):
                for i, (x,) in enumerate(loader):
                    lite.backward(model(x).sum())
                    if i == 1 and run.is_global_zero:
                        break  # rank 0 alone stops early
        if mode == "dtensor":
            model = lite.setup(torch.nn.Linear(4, 6))
            if run.is_global_zero:
                print(float(sum(p.detach().pow(2).sum() for p in model.parameters())))  # rank 0 alone
            torch.distributed.barrier()  # raw: the gather ledger cannot see a rank waiting in it
        if mode == "sigterm":
            lite.barrier()  # every rank wrote its pid file (a busy machine may start one late)
            if run.is_global_zero:
                Path(f"{OUT}.ready").touch()  # the test sends SIGTERM now
        if mode not in ("backward", "break", "dtensor") and run.global_rank != 1:
            lite.all_reduce(torch.ones(2))  # rank 1 skipped it
except BaseException as e:  # noqa: BLE001 - report whatever came out
    outcome.update(error=type(e).__name__, message=str(e))
outcome["pids"] = [int(Path(f"{OUT}.pid{rank}").read_text()) for rank in range(3)]
with open(OUT, "w") as f:
    json.dump(outcome, f)
