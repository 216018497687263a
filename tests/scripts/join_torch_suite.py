"""torch's uneven-input scenarios (distributed_test.py) through lite.join, many in one launch.

argv: strategy ranks suite
  suite "torch": test_ddp_uneven_inputs (every model variant, no_sync every 1/2/3, every
  iteration mapping, a rank with zero iterations; torch's manual step ``param += grad``),
  test_ddp_grad_div_uneven_inputs (the model's own zero_grad, no optimizer),
  test_ddp_join_model_equivalence, even inputs (test_ddp_uneven_input_join_disable).
  suite "train": every strategy: SGD or AdamW with a StepLR, accumulation windows of 1/2/3
  micro-batches (lite.no_backward_sync), a BatchNorm net, clipping by norm and by value,
  collectives between forward and backward and after the loop inside the block, both
  divisors, a rank with no batch; and an evaluation under no_grad over a set-up loader.
  "nostep" after the suite: serving ranks do not mirror optimizer.step (the control).
Half the scenarios loop over a loader from setup_dataloader (free while every rank has data),
half over range() (the protocol's rounds from the start).
Rank 0 writes every scenario's record from every rank: per-rank parameters and buffers after
the block, and what the scenario checks along the way.
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, write
from _torch_models import STEP, _moments, build, eval_data, example_input, make_optimizer, scenarios, step_input

name, ranks, suite = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if sys.argv[4:] == ["nostep"]:  # a deliberately wrong replay: the test must notice
    from scopedlite._strategies.join import events as join_events
    from scopedlite._strategies.join.message import Action

    original_apply = join_events.EventRecorder.apply
    join_events.EventRecorder.apply = lambda self, event, rank: (
        None if event.action == Action.OPTIMIZER_STEP else original_apply(self, event, rank)
    )

if name == "fsdp":
    strategy = lite.FSDPStrategy()
elif name.startswith("deepspeed"):
    stage, offload = int(name.split("_")[2]), name.endswith("_offload")  # deepspeed_stage_3_offload
    strategy = lite.DeepSpeedStrategy(stage=stage, offload_optimizer=offload, offload_parameters=offload and stage == 3)
elif suite == "torch":
    strategy = lite.DDPStrategy(bucket_cap_mb=1)
else:
    strategy = name


class Steps(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def iterations(n, via_loader):
    """The scenario's loop: over a set-up loader of n batches on this rank, or range(n)."""
    if not via_loader:
        return range(n)
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(Steps(n), batch_size=1), use_distributed_sampler=False)
    return (int(i) for i in loader)


def state(model):
    """Full parameters and buffers of the set-up model, on every rank."""
    inner = lite.current().strategy.unwrap(model)
    if name.startswith("deepspeed"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(inner.parameters())):
            params = [p.detach().float().flatten().tolist() for p in inner.parameters()]
    else:
        params = [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
            for p in inner.parameters()
        ]
    return {"params": params, "buffers": [b.detach().double().flatten().tolist() for b in inner.buffers()]}


def manual_step(model):
    """torch's _model_step (a step by hand, then the gradient dropped); descending by STEP
    times the gradient, where torch ascends by the whole of it, so no value overflows."""
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param -= STEP * param.grad
            param.grad = None


def run_uneven(case, rank, world):
    """test_ddp_uneven_inputs: one model variant, one no_sync interval, one mapping."""
    kind, interval, mapping, via_loader = case["model"], case["interval"], case["mapping"], case["loader"]
    options = lite.current().strategy.ddp_options  # torch searches unused parameters for these
    options["find_unused_parameters"] = kind.startswith("unused")
    model = lite.setup(build(kind, seed=0))
    done = 0
    with lite.join(model):
        for i in iterations(mapping[rank], via_loader):
            context = model.no_sync() if i % interval != 0 else torch.enable_grad()
            with context:
                out = model(*step_input(kind, rank))
                out.sum().backward()
                manual_step(model)
            done += 1
    return {"done": done, **state(model)}


def run_grad_div(case, rank, world):
    """test_ddp_grad_div_uneven_inputs: the gradient at every iteration, model.zero_grad()."""
    model = lite.setup(torch.nn.Linear(5, 5, bias=False))
    x = torch.ones(1, 5) * 50
    grads = []
    n = 3 if rank == 0 else 5
    with lite.join(model, divide_by_initial_world_size=case["divide"]):
        for _ in iterations(n, case["loader"]):
            model(x).sum().backward()
            grad = next(iter(model.parameters())).grad
            grads.append(
                (grad.to_local() if hasattr(grad, "to_local") else grad).flatten().tolist()
            )  # fsdp: this rank's shard
            model.zero_grad()
    return {"grads": grads, **state(model)}


def run_equivalence(case, rank, world):
    """test_ddp_join_model_equivalence: SGD, lr * world, rank r runs 2 (r + 1) iterations."""
    base = build("equivalence", seed=0)
    model, opt = lite.setup(base, torch.optim.SGD(base.parameters(), lr=0.03 * world))
    x = example_input("equivalence")
    with lite.join(model):
        for _ in iterations(2 * (rank + 1), case["loader"]):
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward() if name == "ddp" else lite.backward(loss)
            opt.step()
    return state(model)


def run_even(case, rank, world):
    """test_ddp_uneven_input_join_disable: even inputs; the gradient is the mean over ranks."""
    model = lite.setup(torch.nn.Linear(1, 1))
    x = torch.ones(1) * rank
    grads = []
    with lite.join(model):
        for _ in iterations(5, case["loader"]):
            grad = lite.current().strategy.unwrap(model).weight.grad
            if grad is not None:
                grad.requires_grad_(False)
                grad.zero_()
            model(x).sum().backward()
            grads.append(lite.current().strategy.unwrap(model).weight.grad.item())
    return {"grads": grads, **state(model)}


def run_train(case, rank, world):
    """SGD or AdamW with a StepLR, accumulation windows, clipping, BatchNorm, a collective
    between forward and backward and one after the loop."""
    kind, window, mapping = case["model"], case["window"], case["mapping"]
    base = build(kind, seed=0)
    model, opt = lite.setup(base, make_optimizer(case["optimizer"], base.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    seen, steps = 0, []
    with lite.join(model, divide_by_initial_world_size=case["divide"]):
        for i in iterations(mapping[rank], case["loader"]):
            x, y = step_input(kind, rank, i)
            sync = i % window == window - 1
            with lite.no_backward_sync(model, enabled=not sync):
                loss = torch.nn.functional.mse_loss(model(x), y)
                summed = lite.all_reduce(loss.detach(), op="sum")  # between forward and backward
                lite.backward(loss)
            if sync:
                if case["clip"] == "norm":
                    lite.clip_gradients(model, opt, max_norm=0.05)
                elif case["clip"] == "value":
                    lite.clip_gradients(model, opt, clip_val=0.01)
                opt.step()
                sched.step()
                opt.zero_grad()
            steps.append([loss.item(), summed.item()])
            seen += 1
        if case["loader"]:  # after the loop, inside the block: waits for the others there
            total = lite.all_reduce(seen)
    if not case["loader"]:  # a loop over range(): the session cannot tell a rank ran out
        total = lite.all_reduce(seen)
    moments = []  # ddp: every rank's optimizer state, which the final broadcast does not touch
    if name == "ddp":
        moments = _moments(opt)
    return {"total": total, "steps": steps, "lr": opt.param_groups[0]["lr"], "moments": moments, **state(model)}


def run_eval(case, rank, world):
    """Evaluation under no_grad inside join over a set-up loader: every sample once."""
    base = build("mlp", seed=0)
    model, _ = lite.setup(base, make_optimizer("sgd", base.parameters()))
    x, y = eval_data()
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3))
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    batches = 0
    with torch.no_grad(), lite.join(model):
        for xb, yb in loader:
            err = torch.nn.functional.mse_loss(model(xb), yb, reduction="sum")
            total += torch.tensor([err.item(), len(xb)], dtype=torch.float64)
            batches += 1
        metric = lite.all_reduce(total)  # after the loop, inside the block
    return {"metric": metric.tolist(), "batches": batches}


RUNNERS = {
    "uneven": run_uneven,
    "grad_div": run_grad_div,
    "equivalence": run_equivalence,
    "even": run_even,
    "train": run_train,
    "eval": run_eval,
}

with lite.launch(strategy=strategy, devices=ranks, accelerator="cpu", timeout=60) as run:
    records = []
    for case in scenarios(suite, name, ranks):
        torch.manual_seed(1234 + run.global_rank)  # ranks differ: DDP must agree anyway
        records.append(RUNNERS[case["run"]](case, run.global_rank, ranks))
    everyone = from_every_rank(records)
    if run.global_rank == 0:
        write(everyone)
