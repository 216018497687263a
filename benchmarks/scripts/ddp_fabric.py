"""The same DDP training with Lightning Fabric (only run when ``lightning`` is importable).

argv: OUT WARMUP STEPS. ``fabric.launch()`` re-executes this script for rank 1, as
scopedlite does. Rank 0 writes the step times to OUT.
"""

from __future__ import annotations

import sys

import torch

try:
    from lightning.fabric import Fabric
except ImportError:  # the standalone package
    from lightning_fabric import Fabric

from workload import BATCH, make_dataset, make_model, make_optimizer, train_timed, write_result

out, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
dataset = make_dataset((warmup + steps) * BATCH * fabric.world_size)
model = make_model()
model, opt = fabric.setup(model, make_optimizer(model))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True))
times, cpu_times = train_timed(model, opt, loader, fabric.backward, warmup)
if fabric.global_rank == 0:
    write_result(
        out,
        {"step_s": times, "step_cpu_s": cpu_times, "threads": torch.get_num_threads(), "world_size": fabric.world_size},
    )
