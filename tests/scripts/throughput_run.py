"""lite.throughput on 2 real ranks, under ddp and then fsdp (two launch blocks, one script).

Writes, per strategy, every (step, metrics) the run's loggers got on global rank 0:
A: even data, no join (window 4, 6 steps); B: a set-up loader of 13 rows inside join, rank 0
with 4 batches and rank 1 with 3 (window 2); C: rank 0 runs out first (2 batches of 2 rows
against 5 batches of 3), then a second, even join block in the same meter.
"""

import torch

import scopedlite as lite
from _common import make_data, make_model, write


class Recorder:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append([step, dict(metrics)])

    def finalize(self, status):
        pass


def train_step(model, opt, x, y):
    lite.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


FLOPS = 176  # one sample of make_model, forward and backward: tests/test_throughput.py counts it and
# checks lite.measure_flops (not called here: importing torch's counter takes seconds)


def blocks(strategy):
    recorder = Recorder()
    with lite.launch(strategy=strategy, devices=2, accelerator="cpu", loggers=recorder, timeout=60) as run:
        rank = run.global_rank
        model = make_model()
        model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
        data = make_data(40)
        rows = lambda n, at: (data.tensors[0][at : at + n], data.tensors[1][at : at + n])  # noqa: E731

        with lite.throughput(window=4, flops_per_sample=FLOPS, peak_flops=1e9) as meter:  # A
            for i in range(6):
                train_step(model, opt, *rows(2, 2 * i))
                meter.step(samples=2)

        loader = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(13), batch_size=2))
        with lite.throughput(window=2, flops_per_sample=FLOPS, peak_flops=1e9) as meter, lite.join(model):  # B
            for x, y in loader:
                train_step(model, opt, x, y)
                meter.step(samples=len(x), tokens=3 * len(x))

        even = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(12), batch_size=2))
        with lite.throughput(window=2, prefix="c/") as meter:  # C
            mine = [rows(2, 2 * i) for i in range(2)] if rank == 0 else [rows(3, 3 * i) for i in range(5)]
            with lite.join(model):
                for x, y in mine:
                    train_step(model, opt, x, y)
                    meter.step(samples=len(x))
            with lite.join(model):
                for x, y in even:
                    train_step(model, opt, x, y)
                    meter.step(samples=len(x))
    return recorder.calls


write({"flops_per_sample": FLOPS, "ddp": blocks("ddp"), "fsdp": blocks("fsdp")})
