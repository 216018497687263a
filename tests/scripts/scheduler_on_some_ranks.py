"""An LR scheduler stepped on rank 0 alone (``if rank == 0: scheduler.step(...)``, as after an
evaluation on rank 0), or an optimizer stepped once more on rank 1 alone, outside lite.join,
under ddp, DeepSpeed, fsdp or model_parallel (FSDP2 over a data-parallel dimension of 2)
(argv: strategy, then ``scheduler``, ``step`` or ``clip`` (``lite.clip_gradients`` by value
on rank 0 alone before a step: where each rank clamps the gradients it holds, no collective
runs), either after ``step-alone,``): refused on every rank at once, naming what each rank's
optimizer did and the fix, at the backward after the first step that differs (the
scheduler's and the clip's: the second backward after it, one step taken apart; the extra
step's: the next one). Before, the replicas parted without a word.

First what a correct script does, which must not be refused and equals plain torch:
- a first model and optimizer are set up, trained one step and dropped; rank 1 still holds
  them (as a garbage collector that has not run yet would). What is compared is the
  optimizers that step, not the ones still alive (an earlier digest of those refused this);
- the second model trains two steps with its scheduler stepped on every rank;
- a lite.join block over uneven batches (rank 0 two, rank 1 one: rank 1's optimizer step is
  replayed while it is joined), then the scheduler on every rank, then one step outside join
  with the gradients clipped by value on every rank.
After the refusal, caught, the next collective pairs.

``step-alone``, under DeepSpeed ZeRO, first: rank 1 alone calls ``opt.step()`` with no backward
since its last step. The engine freed its gradients at that step, and DeepSpeed failed deep
inside with ``TypeError: 'NoneType' object is not iterable``; it is refused at once on rank 1,
before the engine is called, and the ranks stay in step (the scheduler's refusal after it
counts one step on each).
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, fsdp_over_data_parallel, full_params, make_model, params, write

LR = 0.1
CLIP = 0.05  # binds: the step's largest gradient is larger (reference() asserts it)


def batches(rank, n):
    g = torch.Generator().manual_seed(40 + rank)
    return [torch.randn(4, 4, generator=g) for _ in range(n)]


def loss_of(model, x):
    return model(x).pow(2).mean()


def reference():
    """Plain torch, one process, the steps the ranks take together before the refusal."""
    data = [batches(r, 6) for r in (0, 1)]
    first = make_model(1)
    first_opt = torch.optim.SGD(first.parameters(), lr=LR)
    (sum(loss_of(first, data[r][0]) for r in (0, 1)) / 2).backward()
    first_opt.step()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(loss, clip=False):
        loss.backward()
        if clip:
            assert max(float(p.grad.abs().max()) for p in model.parameters()) > CLIP
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()

    for i in (1, 2):
        step(sum(loss_of(model, data[r][i]) for r in (0, 1)) / 2)
        sched.step()
    step(sum(loss_of(model, data[r][3]) for r in (0, 1)) / 2)  # in join, both ranks have data
    step(loss_of(model, data[0][4]) / 2)  # rank 1 joined: its share is zero, divided by 2
    sched.step()
    step(sum(loss_of(model, data[r][5]) for r in (0, 1)) / 2, clip=True)
    return params(model), opt.param_groups[0]["lr"]


def train(model, opt, x, clip=False):
    lite.backward(loss_of(model, x))
    if clip:
        lite.clip_gradients(model, opt, clip_val=CLIP)
    opt.step()
    opt.zero_grad()


strategy, *before, asymmetry = [sys.argv[1], *sys.argv[2].split(",")]
chosen = (
    lite.ModelParallelStrategy(fsdp_over_data_parallel, data_parallel=2) if strategy == "model_parallel" else strategy
)
with lite.launch(strategy=chosen, devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    data = batches(rank, 8)
    first_net = make_model(1)
    first, first_opt = lite.setup(first_net, torch.optim.SGD(first_net.parameters(), lr=LR))
    train(first, first_opt, data[0])
    kept = [first, first_opt] if rank == 1 else []  # rank 1 alone still holds them
    del first, first_opt, first_net

    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x in data[1:3]:
        train(model, opt, x)
        sched.step()
    with lite.join(model):
        for x in data[3:5] if rank == 0 else data[3:4]:
            train(model, opt, x)
    sched.step()
    train(model, opt, data[5], clip=True)
    expected, lr = reference()
    out = {"trained": full_params(model), "reference": expected, "lr": opt.param_groups[0]["lr"], "lr_ref": lr}
    out["error"] = out["refused_at"] = out["alone"] = None
    if before == ["step-alone"] and rank == 1:
        try:
            opt.step()  # no backward since its last step, rank 1 alone
        except RuntimeError as e:
            out["alone"] = str(e)
    if asymmetry == "scheduler" and rank == 0:
        sched.step()  # rank 0 alone: its rate halves once more
    if asymmetry == "step" and rank == 1:
        opt.step()  # rank 1 alone steps once more
    for i, x in enumerate(data[6:8]):
        try:
            train(model, opt, x, clip=asymmetry == "clip" and rank == 0 and i == 0)  # rank 0 alone
        except RuntimeError as e:
            out["error"], out["refused_at"] = str(e), i
            break
    out["after"] = float(lite.all_reduce(torch.tensor(float(rank + 1)), op="sum"))
    seen = from_every_rank(out)
    if rank == 0:
        write(seen)
