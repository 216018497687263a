"""The same DDP training in raw PyTorch, started by ``python -m torch.distributed.run``.

argv: OUT WARMUP STEPS. Builds the process group, ``DistributedDataParallel`` and a
``DistributedSampler`` itself, as a torchrun user would. Rank 0 writes the step times to OUT.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from workload import BATCH, make_dataset, make_model, make_optimizer, train_timed, write_result

out, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

dist.init_process_group("gloo")
world_size, rank = dist.get_world_size(), dist.get_rank()
dataset = make_dataset((warmup + steps) * BATCH * world_size)
model = DistributedDataParallel(make_model())
opt = make_optimizer(model)
sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
times, cpu_times = train_timed(model, opt, loader, lambda loss: loss.backward(), warmup)
if rank == 0:
    write_result(
        out, {"step_s": times, "step_cpu_s": cpu_times, "threads": torch.get_num_threads(), "world_size": world_size}
    )
dist.destroy_process_group()
