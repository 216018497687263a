"""A step skipped on one rank under ddp, outside lite.join, is refused on every rank at once.

Before, each later backward was averaged with another step's of the other rank, silently,
until a collective of another size aborted the process. Cases, in one launch of 2 ranks:

- ``hooked``: the user's own communication hook (registered after lite.setup) reduces the
  buckets, and training equals plain torch's; rank 0 alone evaluates under torch.no_grad()
  in between (no refusal);
- ``after_join``: an uneven lite.join block, then even steps (the counts start again);
- ``skip``: rank 1 skips the backward and step of its 4th batch: every rank raises at the
  next backward it runs (rank 0 at its 4th, rank 1 at its 5th), naming the fix.
"""

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, params, write

LR = 0.1


def batches(rank, n):
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 4, generator=g) for _ in range(n)]


def step(model, opt, x):
    lite.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()


def reference(steps):
    """Plain torch, one process: each step the mean of the two ranks' losses."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = [batches(r, steps) for r in (0, 1)]
    for i in range(steps):
        (sum(model(data[r][i]).pow(2).mean() for r in (0, 1)) / 2).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def mine(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    model.register_comm_hook(None, mine)
    for i, x in enumerate(batches(rank, 4)):
        step(model, opt, x)
        if i == 1 and rank == 0:
            with torch.no_grad():
                model(x)  # rank 0 alone evaluates
    out = {"hook_calls": calls[0], "hooked": params(model), "reference": reference(4)}

    with lite.join(model):
        for x in batches(rank, 3 + rank):
            step(model, opt, x)
    for x in batches(rank, 2):
        step(model, opt, x)
    out["after_join"] = True

    error, at = None, None
    try:
        for i, x in enumerate(batches(rank, 6)):
            loss = model(x).pow(2).mean()
            if rank == 1 and i == 3:
                continue  # "not finite" on this rank only
            at = i
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        error = str(e)
    out.update(error=error, at=at)
    seen = from_every_rank(out)
    if run.is_global_zero:
        write(seen)
