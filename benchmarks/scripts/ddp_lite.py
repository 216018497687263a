"""DDP training with scopedlite: ``launch`` + ``setup`` + ``setup_dataloader`` + ``backward``.

argv: OUT WARMUP STEPS. Started as ``python ddp_lite.py ...``; scopedlite re-executes this
same command line for rank 1. Rank 0 (the main process) writes the step times to OUT.
"""

from __future__ import annotations

import sys

import torch

import scopedlite as lite
from workload import BATCH, make_dataset, make_model, make_optimizer, train_timed, write_result

out, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
    dataset = make_dataset((warmup + steps) * BATCH * run.world_size)
    model = make_model()
    model, opt = lite.setup(model, make_optimizer(model))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True))
    times, cpu_times = train_timed(model, opt, loader, lite.backward, warmup)
    if run.is_global_zero:
        write_result(
            out,
            {
                "step_s": times,
                "step_cpu_s": cpu_times,
                "threads": torch.get_num_threads(),
                "world_size": run.world_size,
            },
        )
