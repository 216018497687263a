"""A training loop left on some ranks only (argv: strategy, case), outside lite.join:

- ``rank0``: rank 0 decides an early stop alone (``if run.is_global_zero and ...: break``) after
  step 3 and reaches the end of its block; rank 1 goes on to training forward 4, whose
  collectives (DDP's gradient all-reduce, FSDP's and ZeRO-3's gathers) wait for rank 0;
- ``rank1``: the same with rank 1 (a worker process) stopping;
- ``uneven``: rank 0 has 3 batches and rank 1 has 4, in a plain loop;
- ``correct``: every rank trains 4 steps; then rank 0 evaluates alone under torch.no_grad()
  (no training forward) and rank 1 reaches the end 2.5 s after rank 0 (several of rank 0's
  reads at the end see it still working): not refused.

Before, the rank at the end waited for the other, itself waiting in the step's collectives,
until the hang watchdog ended the run (120 s by default) or, with it off, launch(timeout=).
"""

import sys
import time

import torch

import scopedlite as lite
from _common import make_model

strategy, case = sys.argv[1], sys.argv[2]
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=300) as run:
    rank = run.global_rank
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 4, generator=g) for _ in range(3 if case == "uneven" and rank == 0 else 4)]
    for step, x in enumerate(batches):
        lite.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        if step == 2 and case == f"rank{rank}":
            print(f"rank {rank} stops early", flush=True)
            break
    if case == "correct":
        if rank == 0 and strategy == "ddp":  # DDP's forward gathers nothing: rank 0 alone may evaluate
            with torch.no_grad():
                model(torch.randn(2, 4))
        if rank == 1:
            time.sleep(2.5)
            print("rank 1 reaches the end late", flush=True)
