"""What ``lite.throughput`` costs a training step.

argv: OUT WARMUP STEPS BLOCKS. One 2-process ddp launch; per block, one pass over the shared
workload in each mode, rotating: ``off`` (no meter), ``window10`` (``lite.throughput(window=10)``,
its default: one all-gather of 10 float64 per rank every 10 steps) and ``window1`` (an exchange
at every step: what a step inside ``lite.join``'s rounds pays). Rank 0 writes the per-step wall
and CPU times of each mode to OUT.
"""

from __future__ import annotations

import contextlib
import sys

import torch

import scopedlite as lite
from workload import BATCH, make_dataset, make_model, make_optimizer, train_timed, write_result

out, warmup, steps, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
MODES = {"off": None, "window10": 10, "window1": 1}
record: dict[str, list[list[float]]] = {name: [] for name in MODES}
cpu: dict[str, list[list[float]]] = {name: [] for name in MODES}
with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
    dataset = make_dataset((warmup + steps) * BATCH * run.world_size)
    model = make_model()
    model, opt = lite.setup(model, make_optimizer(model))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=BATCH))
    for block in range(blocks):
        names = list(MODES)
        for name in names[block % 3 :] + names[: block % 3]:
            window = MODES[name]
            lite.barrier()
            with lite.throughput(window=window) if window else contextlib.nullcontext() as meter:

                def backward(loss, meter=meter):
                    lite.backward(loss)
                    if meter is not None:
                        meter.step(samples=BATCH)

                times, cpu_times = train_timed(model, opt, loader, backward, warmup)
            record[name].append(times)
            cpu[name].append(cpu_times)
    if run.is_global_zero:
        write_result(out, {"steps": record, "cpu": cpu})
