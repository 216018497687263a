"""A collective of ours on rank 0 alone, outside lite.join (argv: strategy): ``if rank == 0:
lite.all_reduce(...)``, as an evaluation on rank 0 does, while the training loop goes on with a
logged ``lite.all_reduce`` on every rank.

First, what correct scripts do, which must go through with the right values: a logged
all-reduce each step, per-rank values passed on one line, a broadcast from rank 0,
gather_for_metrics of rows that differ in number by rank, a barrier after rank 0 works alone.

Then calls that would pair wrongly, each refused (the first two caught: the ranks stay
in step):
- the same collective written on two lines (``if rank == 0: ... else: ...``): refused at once,
  naming both lines and the one-line form (it passed before; inside lite.join the rounds
  refused it, but only once a rank had run out of data); so is a broadcast whose ranks name
  different sources (``src=rank``: every rank sent) or call it from two lines, or that meets
  an all-reduce; so is a gather_for_metrics meeting an all-reduce (gloo aborted the process:
  the one all-gathered its check's row, the other all-reduced it);
- a lone call through a helper (``logged(100.0)`` on rank 0 alone, meeting rank 1's next call
  of it): both run the helper's line, and both got 102 before; the callers tell them apart
  now, and both are refused at once (caught), naming each rank's line and callers.
- rank 0's lone call from a line of its own, meeting rank 1's all-reduce of the same shape:
  both returned a mix of the two (102) before, and only rank 0's next call was refused; now
  the lines tell them apart and both raise at once (uncaught: the run ends).
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
        out["branches"].append(float(lite.all_reduce(torch.tensor(10.0 if rank == 0 else 0.0))))
    out["broadcast"] = lite.broadcast("from rank 0" if rank == 0 else None, src=0)
    out["rows"] = lite.gather_for_metrics(torch.arange(rank + 1)).tolist()
    if rank == 0:
        time.sleep(1.0)  # rank 0 works alone; the others wait for it in the barrier
    lite.barrier()

    def refused(call):
        try:
            return f"no error: {call()}"
        except lite.CollectiveMismatchError as e:
            return f"{type(e).__name__}: {e}"

    if rank == 0:  # the same collective from two lines
        out["two_lines"] = refused(lambda: lite.all_reduce(torch.tensor(10.0)))
    else:
        out["two_lines"] = refused(lambda: lite.all_reduce(torch.tensor(0.0)))
    out["broadcast_src"] = refused(lambda: lite.broadcast("mine", src=rank))  # each rank names itself
    if rank == 0:  # a broadcast from two lines: rank 1 would receive what rank 0 sent at its own
        out["broadcast_lines"] = refused(lambda: lite.broadcast("config", src=0))
    else:
        out["broadcast_lines"] = refused(lambda: lite.broadcast(None, src=0))
    if rank == 0:  # a broadcast on rank 0 meeting rank 1's all-reduce
        out["kinds"] = refused(lambda: lite.broadcast("config", src=0))
    else:
        out["kinds"] = refused(lambda: lite.all_reduce(torch.tensor(1.0)))

    if rank == 0:  # gather_for_metrics on rank 0 meeting rank 1's all-reduce
        out["metrics_kinds"] = refused(lambda: lite.gather_for_metrics(torch.arange(3)))
    else:
        out["metrics_kinds"] = refused(lambda: lite.all_reduce(torch.tensor(1.0)))

    def logged(value):
        return float(lite.all_reduce(torch.tensor(value)))

    if rank == 0:  # rank 0 alone, through the helper: it meets rank 1's next call of it
        out["helper"] = refused(lambda: logged(100.0))
    else:
        out["helper"] = refused(lambda: logged(2.0))
    step()
    if rank == 0:
        write(out)
        lite.all_reduce(torch.tensor(100.0))  # rank 0 alone, from a line of its own
    print(f"rank {rank} got {float(lite.all_reduce(torch.tensor(float(rank + 1))))}", flush=True)
    raise AssertionError("the collective on rank 0 alone was not refused")
