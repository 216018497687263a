"""A step skipped on one rank under ddp or DeepSpeed, outside lite.join, is refused on every
rank at once.

Before, each later backward was reduced with another step's of the other rank, silently, until
a collective of another size aborted the process (DDP) or hung at the end (DeepSpeed). Cases,
in one launch of 2 ranks (argv: strategy, default ddp):

- ``hooked``: training equals plain torch's; under ddp the user's own communication hook
  (registered after lite.setup) reduces the buckets; rank 0 alone evaluates under
  torch.no_grad() in between (no refusal; not under ZeRO-3, whose forward gathers);
- ``after_join``: an uneven lite.join block, then even steps (the counts start again);
- ``join_refused``: inside a lite.join block the ranks call different collectives (rank 0
  logs a sum where rank 1 takes a max); every rank is refused there at once and catches it;
  the counts start again there too (before, the check stayed off for the rest of the run, and
  the ``skip`` below went unrefused: gloo aborted the process);
- ``skip``: rank 1 skips the backward and step of its 4th batch: every rank raises at the
  next backward it runs (rank 0 at its 4th, rank 1 at its 5th), naming the fix; the next
  collective pairs. Not under ZeRO-3, whose forwards gather: there rank 1's next forward is
  refused and the run ends (skip_on_gathering.py).
- ``native`` (DeepSpeed): the same with DeepSpeed's own ``model.backward(loss)`` and
  ``model.step()``, after three even steps that equal plain torch's (before, unchecked: the
  skip went on silently with mixed gradients).
"""

import sys

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


strategy = sys.argv[1] if len(sys.argv) > 1 else "ddp"
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def mine(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    if strategy == "ddp":
        model.register_comm_hook(None, mine)
    for i, x in enumerate(batches(rank, 4)):
        step(model, opt, x)
        if i == 1 and rank == 0 and strategy != "deepspeed_stage_3":  # ZeRO-3 refuses it (it gathers)
            with torch.no_grad():
                model(x)  # rank 0 alone evaluates
    out = {"hook_calls": calls[0], "hooked": params(model), "reference": reference(4)}

    with lite.join(model):
        for x in batches(rank, 3 + rank):
            step(model, opt, x)
    for x in batches(rank, 2):
        step(model, opt, x)
    out["after_join"] = True

    try:
        with lite.join(model):
            for i, x in enumerate(batches(rank, 6)):
                step(model, opt, x)
                if i == 2 and rank == 0:
                    lite.all_reduce(torch.ones(1), op="sum")  # refused on every rank at once
                elif i == 2:
                    lite.all_reduce(torch.ones(1), op="max")
        out["join_refused"] = None
    except RuntimeError as e:
        out["join_refused"] = str(e)
    for x in batches(rank, 2):
        step(model, opt, x)

    # Where a forward gathers (ZeRO-3) the skip is refused at the next forward and ends the
    # run: skip_on_gathering.py.
    gathers = strategy == "deepspeed_stage_3"
    error, at = None, None
    try:
        for i, x in enumerate([] if gathers else batches(rank, 6)):
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
    out["after"] = float(lite.all_reduce(torch.tensor(float(rank + 1)), op="sum"))

    if strategy.startswith("deepspeed"):  # DeepSpeed's own calls: model.backward, model.step
        net = make_model()
        model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
        for x in batches(rank, 3):
            model.backward(model(x).pow(2).mean())
            model.step()
        out["native"] = params(model)
        out["native_reference"] = reference(3)
        out["native_error"], out["native_at"] = None, None
        try:
            for i, x in enumerate([] if gathers else batches(rank, 6)):
                loss = model(x).pow(2).mean()
                if rank == 1 and i == 3:
                    continue
                out["native_at"] = i
                model.backward(loss)
                model.step()
        except RuntimeError as e:
            out["native_error"] = str(e)
        out["native_after"] = float(lite.all_reduce(torch.tensor(float(rank + 1)), op="sum"))
    seen = from_every_rank(out)
    if run.is_global_zero:
        write(seen)
