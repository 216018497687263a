"""A collective of ours on rank 0 alone, outside lite.join (argv: strategy): ``if rank == 0:
lite.all_reduce(...)``, as an evaluation on rank 0 does, while the training loop goes on with a
logged ``lite.all_reduce`` on every rank.

Rank 0's lone call meets rank 1's logged all-reduce, of the same shape: both return a wrong
value, and nothing can tell the two calls apart yet. Rank 0's own logged call then finds rank
1 gone on to its next training forward and is refused there, at once, naming the fix. Before,
that call met rank 1's gradient all-reduce (ddp: gloo aborted the process) or its gathers
(fsdp: a wait until launch(timeout=)). (Where the others' next step is a training forward, the
lone call itself is refused: tests/test_collective_order.py runs stall.py's ``backward``.)

First, what correct scripts do, which must go through with the right values: a logged
all-reduce each step, the same collective from two lines (``if rank == 0: ... else: ...``), a
broadcast from rank 0, gather_for_metrics of rows that differ in number by rank, a barrier
after rank 0 works alone.
"""

import sys
import time

import torch

import scopedlite as lite
from _common import make_model, write

strategy = sys.argv[1]
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    out = {"logged": [], "branches": []}

    def step():
        lite.backward(model(torch.ones(2, 4)).sum())
        opt.step()
        opt.zero_grad()
        out["logged"].append(float(lite.all_reduce(torch.tensor(float(rank + 1)))))

    for _ in range(2):
        step()
        if rank == 0:  # the same collective from another line: it runs on every rank
            out["branches"].append(float(lite.all_reduce(torch.tensor(10.0))))
        else:
            out["branches"].append(float(lite.all_reduce(torch.tensor(0.0))))
    out["broadcast"] = lite.broadcast("from rank 0" if rank == 0 else None, src=0)
    out["rows"] = lite.gather_for_metrics(torch.arange(rank + 1)).tolist()
    if rank == 0:
        time.sleep(1.0)  # rank 0 works alone; the others wait for it in the barrier
    lite.barrier()
    if rank == 0:
        write(out)
        lite.all_reduce(torch.tensor(100.0))  # rank 0 alone: it meets rank 1's logged call below
    print(f"rank {rank} logged {float(lite.all_reduce(torch.tensor(float(rank + 1))))}", flush=True)
    for _ in range(2):
        step()
    raise AssertionError("the collective on rank 0 alone was not refused")
