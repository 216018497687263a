"""Under a strategy whose forwards gather parameters (argv: fsdp, model_parallel - an FSDP2
plan over 2 data-parallel ranks - or deepspeed_stage_3), a step
whose backward rank 1 skips is refused at that rank's next forward, before its gathers meet
rank 0's backward; before, the run hung until the collective timeout or the watchdog.

First three even steps of two forwards each on every rank (a sum of two losses, as a GAN's
discriminator step: the check reads there and lets it pass), with an evaluation under
no_grad on every rank after each: the parameters are plain torch's. Then rank 1 skips the
backward of its 4th batch: its 5th forward raises, naming rank 0's backward and the fix, and
the run ends (rank 0 waits in that backward's collectives). Rank 1 catches it and calls a
collective: the refusal is raised again there, not left to meet rank 0's backward.
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, fsdp_over_data_parallel, make_model, params, write

LR = 0.1


def batches(rank, n):
    g = torch.Generator().manual_seed(30 + rank)
    return [torch.randn(4, 4, generator=g) for _ in range(n)]


def loss_of(model, x):
    return model(x).pow(2).mean() + model(2 * x).pow(2).mean()


def whole(model):
    """The full parameters (every rank calls it: it gathers)."""
    if strategy in ("fsdp", "model_parallel"):  # (FSDP2 leaves a root gathered after a no_grad forward)
        return [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
            for p in model.parameters()
        ]
    return [v.flatten().tolist() for v in model.state_dict().values()]


def reference(steps):
    """Plain torch, one process: each step the mean of the two ranks' losses."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = [batches(r, steps) for r in (0, 1)]
    for i in range(steps):
        (sum(loss_of(model, data[r][i]) for r in (0, 1)) / 2).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


strategy = sys.argv[1]
chosen = (
    lite.ModelParallelStrategy(fsdp_over_data_parallel, data_parallel=2) if strategy == "model_parallel" else strategy
)
with lite.launch(strategy=chosen, devices=2, accelerator="cpu", timeout=120) as run:
    rank = run.global_rank
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    for x in batches(rank, 3):
        lite.backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)
    seen = from_every_rank({"trained": whole(model), "reference": reference(3)})
    if rank == 0:
        write(seen)
    try:
        for i, x in enumerate(batches(rank, 6)):
            loss = loss_of(model, x)
            if rank == 1 and i == 3:
                continue  # "not finite" on this rank only
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
    except RuntimeError:
        lite.all_reduce(torch.ones(1), op="sum")  # caught, it cannot go on: raised again here
    raise AssertionError(f"rank {rank}: the skipped backward was not refused")
