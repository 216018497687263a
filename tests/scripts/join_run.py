"""Uneven data under lite.join: training, collectives everywhere in the loop, no_grad eval.

argv: strategy devices configs   (configs: "n:batch_size:divide,..." with divide 1 for
divide_by_initial_world_size; several configurations share one launch)
Rank 0 writes what every rank saw and computed, per configuration, and after them how many
rounds of the join protocol ran over an even loader (``rounds_on_even_data``).
"""

import sys
from functools import partial

import torch

import scopedlite as lite
from _common import from_every_rank, make_data, make_model, params, write

strategy, devices = sys.argv[1], int(sys.argv[2])
configs = [tuple(int(v) for v in c.split(":")) for c in sys.argv[3].split(",")]


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.data = make_data(n)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return i, x, y


def run_config(rank, n, batch_size, divide):
    model = make_model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(Indexed(n), batch_size=batch_size))
    record = {"rank": rank, "train": [], "seen": [], "padded_seen": [], "eval": []}

    # Outside join: padded, even counts.
    for idx, _, _ in loader:
        record["padded_seen"] += idx.tolist()
    record["len_outside"] = len(loader)

    with lite.join(model, divide_by_initial_world_size=divide):
        record["len_inside"] = len(loader)
        for idx, x, y in loader:
            active_top = lite.all_reduce(1, op="sum")  # top of the loop, before forward
            loss = torch.nn.functional.mse_loss(model(x), y)
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
            step = {
                "idx": idx.tolist(),
                "local": loss.item(),
                "active_top": active_top,
                "mean": lite.all_reduce(loss.detach(), op="mean").item(),
                "sum": lite.all_reduce(loss.detach(), op="sum").item(),
                "max_rank": lite.all_reduce(torch.tensor(rank), op="max").item(),
                "min_rank": lite.all_reduce(rank, op="min"),
                "gathered": lite.all_gather(torch.tensor([rank])).flatten().tolist(),
                "from0": lite.broadcast({"hello": 0} if rank == 0 else None, src=0),
                "nested": lite.all_reduce({"a": [1, 2.0]}, op="sum"),
            }
            lite.barrier()
            record["train"].append(step)
            record["seen"] += idx.tolist()

    # Evaluation under no_grad inside join, with a running metric reduced every step.
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), lite.join(model):
        for idx, x, y in loader:
            err = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
            total += err.item()
            count += len(idx)
            running = lite.all_reduce(torch.tensor([err.item(), float(len(idx))], dtype=torch.float64), op="sum")
            record["eval"].append({"idx": idx.tolist(), "running": running.tolist()})
    metric = lite.all_reduce(torch.tensor([total, float(count)], dtype=torch.float64), op="sum")
    record["metric"] = metric.tolist()
    record["params"] = params(lite.current().strategy.unwrap(model))
    return record


def gathers_during(fn) -> int:
    """How many all-gathers this rank ran during ``fn()`` (torch's profiler sees every c10d op):
    the join protocol's rounds, each one all-gather of every rank's step message."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("c10d::") and "gather" in e.name)


def rounds_on_even_data(world_size):
    """The protocol's rounds in a join block while every rank has data, for 2 and for 5 steps:
    over a set-up loader (free when even, so as many for 5 steps as for 2) and over a plain
    list of the same batches ("list2", "list5": the rounds of a loop whose length nobody knows)."""

    def block(model, opt, batches):
        with lite.join(model):
            for x, y in batches:
                lite.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()

    counts = {}
    for steps in (2, 5):
        model = make_model()
        model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(2 * steps * world_size), batch_size=2))
        listed = list(loader)
        counts[str(steps)] = gathers_during(partial(block, model, opt, loader))
        counts[f"list{steps}"] = gathers_during(partial(block, model, opt, listed))
    return counts


with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=60) as run:
    records = [run_config(run.global_rank, n, b, d == 1) for n, b, d in configs]
    records.append({"even_rounds": rounds_on_even_data(run.world_size)})  # after the configurations' records
    everyone = from_every_rank(records)
    if run.global_rank == 0:
        write(everyone)
