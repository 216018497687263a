"""torch's generic Join tests (test/distributed/algorithms/test_join.py) through lite.join.

argv: strategy ranks. torch's ``AllReducer`` is a joinable whose per-iteration collective is an
all-reduce of a one; its join hook all-reduces zeros for a rank that has joined, so each
iteration's sum counts the ranks still iterating, and its post hook broadcasts a constant from
the last joiner. Here the joinables are set-up models and the collectives ``lite``'s. Rank r has
``BASE + r * OFFSET`` inputs (torch's 3 and 1), a plain list of zeros, as torch builds them:

- ``main``: ``lite.all_reduce(torch.ones(1))`` once and twice per iteration (torch's
  ``num_allreduces`` kwarg), over the plain list and over a set-up loader of the same length;
- ``post``: no collective in the loop (torch's ``num_allreduces=0``), then the post work: the
  last joiner found with ``lite.all_gather`` and a constant broadcast from it, after the loop
  inside the block over a set-up loader, after the block over the plain list;
- ``multiple``: two set-up models in one block (an MLP with AdamW, a BatchNorm MLP with SGD, each
  with a StepLR), an all-reduce of a one per model per iteration, a training step of each, and
  the post work per model after the block; their state after it;
- ``throw``: the rank with the fewest inputs raises when it runs out, inside the block (torch's
  ``throw_on_early_termination`` message); the others are in their loop;
- ``throw_by_hand``: ``throw_on_early_termination`` written with lite collectives inside the
  block: each iteration all-reduces (max) whether a rank has run out, and every rank raises at
  the same iteration.

After each throwing scenario a collective outside the block shows whether the ranks are in step.
Rank 0 writes every rank's records; tests/test_join_generic.py computes what each should be.
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, write
from _torch_models import _moments, build, make_optimizer, step_input

BASE, OFFSET = 3, 1
BEFORE, AFTER = 41, 42  # torch's constants for the post hooks
# AdamW on the MLP, not on the BatchNorm MLP: the bias of the Linear before BatchNorm has a
# gradient of exactly zero, which AdamW would turn into full steps of rounding noise
MODELS = [("mlp", "adamw"), ("bn_mlp", "sgd")]

name, ranks = sys.argv[1], int(sys.argv[2])


def state(model):
    """Full parameters and buffers of the set-up model, on every rank."""
    inner = lite.current().strategy.unwrap(model)
    params = [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist() for p in inner.parameters()
    ]
    return {"params": params, "buffers": [b.detach().double().flatten().tolist() for b in inner.buffers()]}


def inputs(rank):
    return [torch.zeros(1) for _ in range(BASE + rank * OFFSET)]


def loader_of(n):
    """A set-up loader of n batches on this rank (the lengths known: no round while all have data)."""
    dataset = torch.utils.data.TensorDataset(torch.zeros(n, 1))
    return lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=1), use_distributed_sampler=False)


def setup_models():
    built = []
    for kind, optimizer in MODELS:
        base = build(kind, seed=0)
        model, opt = lite.setup(base, make_optimizer(optimizer, base.parameters()))
        built.append((kind, model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)))
    return built


def post_work(done, rank, value):
    """torch's post hook: the last joiner (the highest rank of those that ran the most
    iterations, found from every rank's count) broadcasts ``value``; the others keep BEFORE."""
    counts = [int(c) for c in lite.all_gather(torch.tensor([done])).flatten().tolist()]
    last = max(r for r, c in enumerate(counts) if c == max(counts))
    mine = torch.tensor([value if rank == last else BEFORE])
    return counts, int(lite.broadcast(mine, src=last).item())


def main(rank):
    model = lite.setup(build("mlp", seed=0))
    record = {}
    for per_iteration in (1, 2):
        for source in ("list", "loader"):
            loop = inputs(rank) if source == "list" else loader_of(len(inputs(rank)))
            total, done = 0.0, 0
            with lite.join(model):
                for _ in loop:
                    for _ in range(per_iteration):
                        total += lite.all_reduce(torch.ones(1)).item()
                    done += 1
            record[f"{source}:{per_iteration}"] = {"total": total, "done": done}
    return record


def post(rank):
    """No collective in the loop; the post work after it, inside the block over a set-up loader
    (it waits there for the others), after the block over a plain list (where a rank that ran
    out cannot be told from one that went on)."""
    model = lite.setup(build("mlp", seed=0))
    record = {}
    for source in ("loader", "list"):
        loop = inputs(rank) if source == "list" else loader_of(len(inputs(rank)))
        done = 0
        with lite.join(model):
            for _ in loop:
                done += 1
            if source == "loader":
                counts, value = post_work(done, rank, AFTER)
        if source == "list":
            counts, value = post_work(done, rank, AFTER)
        record[source] = {"done": done, "counts": counts, "value": value}
    return record


def multiple(rank):
    models = setup_models()
    total, done = 0.0, 0
    with lite.join(*(model for _, model, _, _ in models)):
        for i, _ in enumerate(inputs(rank)):
            for kind, model, opt, sched in models:
                x, y = step_input(kind, rank, i)
                loss = torch.nn.functional.mse_loss(model(x), y)
                total += lite.all_reduce(
                    torch.ones(1)
                ).item()  # the joinable's collective, between forward and backward
                lite.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            done += 1
    posts = [post_work(done, rank, AFTER + j) for j in range(len(models))]  # a plain list: after the block
    record = {"total": total, "done": done, "posts": posts, "models": []}
    for _, model, opt, _ in models:
        moments = _moments(opt) if name == "ddp" else []  # ddp: each rank's own optimizer state
        record["models"].append({"lr": opt.param_groups[0]["lr"], "moments": moments, **state(model)})
    return record


def throw(rank, world):
    """The rank with the fewest inputs raises when it runs out; the others are iterating."""
    models = setup_models()
    fewest = min(range(world), key=lambda r: len(inputs(r)))
    total, done, error = 0.0, 0, None
    try:
        with lite.join(*(model for _, model, _, _ in models)):
            for i, _ in enumerate(inputs(rank)):
                for kind, model, opt, _ in models:
                    total += lite.all_reduce(torch.ones(1)).item()
                    x, y = step_input(kind, rank, i)
                    lite.backward(torch.nn.functional.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
                done += 1
            if rank == fewest:
                raise RuntimeError(f"Rank {rank} exhausted all inputs.")
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    return {"total": total, "done": done, "error": error, "after": lite.all_reduce(float(rank + 1))}


def throw_by_hand(rank):
    """torch's throw_on_early_termination, written with lite.all_reduce inside the block."""
    models = setup_models()
    total, done, error = 0.0, 0, None
    try:
        with lite.join(*(model for _, model, _, _ in models)):
            remaining = iter(inputs(rank))
            while True:
                item = next(remaining, None)
                if lite.all_reduce(float(item is None), op="max") > 0:
                    if item is None:
                        raise RuntimeError(f"Rank {rank} exhausted all inputs.")
                    raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
                for kind, model, opt, _ in models:
                    total += lite.all_reduce(torch.ones(1)).item()
                    x, y = step_input(kind, rank, done)
                    lite.backward(torch.nn.functional.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
                done += 1
    except RuntimeError as e:
        error = f"{type(e).__name__}: {e}"
    return {"total": total, "done": done, "error": error, "after": lite.all_reduce(float(rank + 1))}


with lite.launch(strategy=name, devices=ranks, accelerator="cpu", timeout=60) as run:
    torch.manual_seed(1234 + run.global_rank)  # ranks differ: the strategy must agree anyway
    rank = run.global_rank
    records = {
        "main": main(rank),
        "post": post(rank),
        "multiple": multiple(rank),
        "throw": throw(rank, run.world_size),
        "throw_by_hand": throw_by_hand(rank),
    }
    everyone = from_every_rank(records)
    if rank == 0:
        write(everyone)
