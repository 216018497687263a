"""LR schedulers inside lite.join on uneven data, as real scripts build them.

argv: strategy

Rank 0 has 6 batches, rank 1 has 3 (plain lists). Three cases, each a fresh model and SGD:

- ``warmup_cosine``: ``SequentialLR`` of a ``LinearLR`` warm-up and a ``CosineAnnealingLR``,
  stepped after every optimizer step (the scheduler every LLM recipe uses; it does not call
  ``LRScheduler.__init__``, so a registry that watched only that would not know it);
- ``chained``: ``ChainedScheduler`` of an ``ExponentialLR`` and a ``LambdaLR``;
- ``before_launch``: a ``StepLR`` built before ``lite.launch`` on the optimizer later set up
  (the run cannot have seen it built), handed to ``lite.join(model, scheduler)``;
- ``before_launch_unnamed``: the same scheduler not handed to ``lite.join``: refused on every
  rank when rank 1 runs out (rank 0's learning rate changes under it), naming the fix, and the
  next collective pairs.

Every rank records its parameters and learning rate after each block; rank 0 writes them with
plain torch's over the same losses (a rank out of data counts zero, the mean over 2).
"""

import sys

import torch
from torch.optim import lr_scheduler as schedulers

import scopedlite as lite
from _common import from_every_rank, make_model, params, write

strategy = sys.argv[1]
LR = 0.1
LENGTHS = {0: 6, 1: 3}


def data(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    return [torch.randn(8, 4, generator=g) for _ in range(LENGTHS[rank])]


def build(case: str, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if case == "warmup_cosine":
        warmup = schedulers.LinearLR(opt, start_factor=0.25, total_iters=2)
        cosine = schedulers.CosineAnnealingLR(opt, T_max=4)
        return schedulers.SequentialLR(opt, [warmup, cosine], milestones=[2])
    if case == "chained":
        return schedulers.ChainedScheduler(
            [schedulers.ExponentialLR(opt, gamma=0.9), schedulers.LambdaLR(opt, lambda step: 1.0 / (1 + step))]
        )
    return schedulers.StepLR(opt, step_size=2, gamma=0.5)


def reference(case: str) -> tuple[list[list[float]], float]:
    """Plain torch, one process: each step's loss is the sum of the running ranks' losses over
    the world size; the scheduler stepped after every step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = build(case, opt)
    batches = {r: data(r) for r in LENGTHS}
    for step in range(max(LENGTHS.values())):
        losses = [model(batches[r][step]).pow(2).mean() for r in LENGTHS if step < LENGTHS[r]]
        (sum(losses) / len(LENGTHS)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return params(model), opt.param_groups[0]["lr"]


def full_params(model: torch.nn.Module) -> list[list[float]]:
    inner = lite.current().strategy.unwrap(model)
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist() for p in inner.parameters()
    ]


early = {}  # case -> (model, optimizer, scheduler) built before the launch block
for case in ("before_launch", "before_launch_unnamed"):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    early[case] = (model, opt, build(case, opt))

result = {}
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=300) as run:
    rank = run.global_rank
    for case in ("warmup_cosine", "chained", "before_launch", "before_launch_unnamed"):
        if case in early:
            model, opt, sched = early[case]
            model, opt = lite.setup(model, opt)
        else:
            model, opt = lite.setup(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=LR)))(make_model()))
            sched = build(case, opt)
        named = (sched,) if case == "before_launch" else ()
        error = None
        try:
            with lite.join(model, *named):
                for x in data(rank):
                    lite.backward(model(x).pow(2).mean())
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        except Exception as e:  # noqa: BLE001 - recorded for the test
            error = f"{type(e).__name__}: {e}"
        after = lite.all_reduce(torch.tensor(float(rank + 1))).item()  # pairs: 1 + 2
        result[case] = {"error": error, "after": after, "params": full_params(model), "lr": opt.param_groups[0]["lr"]}
        del model, opt, sched
    everyone = from_every_rank(result)
    if rank == 0:
        expected = {case: reference(case) for case in ("warmup_cosine", "chained", "before_launch")}
        write({"ranks": everyone, "reference": expected})
