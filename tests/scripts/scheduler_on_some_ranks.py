"""An LR scheduler stepped on rank 0 alone (``if rank == 0: scheduler.step(...)``, as after an
evaluation on rank 0), outside lite.join, under ddp or DeepSpeed (argv: strategy): the next
backward is refused on every rank at once, naming each rank's learning rate and the fix,
before an optimizer step with different rates. Before, each rank stepped its copy with its
own rate and the replicas parted without a word.

First two steps with the scheduler stepped on every rank: the parameters are plain torch's
(StepLR halving the rate each step). After the refusal, caught, the next collective pairs.
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, params, write

LR = 0.1


def batches(rank, n):
    g = torch.Generator().manual_seed(40 + rank)
    return [torch.randn(4, 4, generator=g) for _ in range(n)]


def reference(steps):
    """Plain torch, one process: each step the mean of the two ranks' losses, then the scheduler."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = [batches(r, steps) for r in (0, 1)]
    for i in range(steps):
        (sum(model(data[r][i]).pow(2).mean() for r in (0, 1)) / 2).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return params(model)


strategy = sys.argv[1]
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = batches(rank, 3)
    for x in data[:2]:
        lite.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        sched.step()
    out = {"trained": params(model), "reference": reference(2), "error": None}
    if rank == 0:
        sched.step()  # rank 0 alone: its rate halves once more
    try:
        lite.backward(model(data[2]).pow(2).mean())
    except RuntimeError as e:
        out["error"] = str(e)
    out["after"] = float(lite.all_reduce(torch.tensor(float(rank + 1)), op="sum"))
    seen = from_every_rank(out)
    if rank == 0:
        write(seen)
