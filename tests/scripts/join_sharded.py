"""lite.join under a sharded strategy (or ddp, for comparison): uneven batches, two epochs each
in its own join block, collectives before forward and between forward and backward, an LR
scheduler, clipping, then a no_grad evaluation inside join over setup_dataloader.

argv: strategy ranks counts divide optimizer clip [extra]
  counts: batches per rank, e.g. "5,3" or "5,3,0" (rank r takes the next counts[r] batches)
  divide: 1 = divide_by_initial_world_size; clip: max_norm or 0; extra: "accumulate" (each
  batch of 2 as two micro-batches of 1, the first inside lite.no_backward_sync: the same
  gradient), or a replay piece to disable on purpose ("nostep": joined ranks do not mirror
  optimizer.step; "nosched")
Rank 0 writes every rank's record.
"""

import sys

import torch
from _common import make_data, make_model, write

import scopedlite as lite
from scopedlite._strategies import join_events
from scopedlite._strategies.join_message import Action

name, ranks, counts = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")]
divide, kind, clip = sys.argv[4] == "1", sys.argv[5], float(sys.argv[6])
extra = sys.argv[7] if len(sys.argv) > 7 else ""
accumulate = extra == "accumulate"
broken = extra if extra in ("nostep", "nosched") else ""
BATCH = 2

if broken:  # a deliberately wrong replay: the test must notice
    skipped = {"nostep": Action.OPTIMIZER_STEP, "nosched": Action.SCHEDULER_STEP}[broken]
    original_apply = join_events.EventRecorder.apply
    join_events.EventRecorder.apply = lambda self, event, rank: None if event.action == skipped else original_apply(self, event, rank)

if name == "fsdp":
    strategy = lite.FSDPStrategy(auto_wrap_policy={torch.nn.Linear})  # three units and a root
elif name.startswith("deepspeed"):
    stage = int(name.split("_")[2])
    offload = name.endswith("_offload")
    strategy = lite.DeepSpeedStrategy(
        stage=stage, config={"gradient_clipping": clip}, offload_optimizer=offload, offload_parameters=offload and stage == 3
    )
else:
    strategy = name


def optimizer(params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def full_params(model):
    if name.startswith("deepspeed"):
        import deepspeed

        inner = lite.current().strategy.unwrap(model)
        with deepspeed.zero.GatheredParameters(list(inner.parameters())):
            return [p.detach().float().flatten().tolist() for p in inner.parameters()]
    inner = lite.current().strategy.unwrap(model)
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist() for p in inner.parameters()]


x_all, y_all = make_data(BATCH * sum(counts)).tensors
with lite.launch(strategy=strategy, devices=ranks, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    start = sum(counts[:rank])
    mine = [(x_all[BATCH * b : BATCH * (b + 1)], y_all[BATCH * b : BATCH * (b + 1)]) for b in range(start, start + counts[rank])]
    model = make_model()
    model, opt = lite.setup(model, optimizer(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    record = {"rank": rank, "steps": [], "lr": []}
    for epoch in range(2):
        with lite.join(model, divide_by_initial_world_size=divide):
            for x, y in mine:
                active = lite.all_reduce(1)  # a collective before the forward
                if accumulate:
                    with lite.no_backward_sync(model):
                        lite.backward(torch.nn.functional.mse_loss(model(x[:1]), y[:1]) / 2)
                    x, y = x[1:], y[1:]
                loss = torch.nn.functional.mse_loss(model(x), y) / (2 if accumulate else 1)
                summed = lite.all_reduce(loss.detach(), op="sum")  # between forward and backward
                lite.backward(loss)
                if clip and not name.startswith("deepspeed"):
                    lite.clip_gradients(model, opt, max_norm=clip)
                opt.step()
                sched.step()
                opt.zero_grad()
                record["steps"].append({"epoch": epoch, "active": active, "local": loss.item(), "sum": summed.item()})
        record["lr"].append(opt.param_groups[0]["lr"])

    # Evaluation under no_grad inside join, over every sample once.
    data = torch.utils.data.TensorDataset(x_all, y_all)
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=3))
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), lite.join(model):
        for x, y in loader:
            err = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
            total += torch.tensor([err.item(), len(x)], dtype=torch.float64)
    record["metric"] = lite.all_reduce(total).tolist()
    record["params"] = full_params(model)
    everyone = [lite.broadcast(record, src=r) for r in range(run.world_size)]
    if rank == 0:
        write(everyone)
