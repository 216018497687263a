"""The model, data and training loop every DDP benchmark script shares.

Keeping them in one place is what makes the comparison fair: the scopedlite, raw-PyTorch
and Fabric scripts differ only in how they start processes and wrap model and loader.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Iterable

import torch

WIDTH = 512  # "MLP, 3 layers of 512"
CLASSES = 10
BATCH = 64


def make_model(seed: int = 0) -> torch.nn.Module:
    """Three Linear layers of width 512 (the last one maps to 10 classes)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, CLASSES),
    )


def make_dataset(n: int, seed: int = 1) -> torch.utils.data.TensorDataset:
    """Synthetic classification data, identical on every rank (same seed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01)


def train_timed(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loader: Iterable[Any],
    backward: Callable[[torch.Tensor], None],
    warmup: int,
) -> tuple[list[float], list[float]]:
    """Run one pass over ``loader``; return the wall and CPU duration of each step after warm-up.

    A step is measured from the end of the previous one to the end of this one, so the time
    to fetch the batch (sampler, collate, the loader wrappers of each library) is included.
    Wall time (``perf_counter``) is the figure that matters; the process's CPU time
    (``process_time``, all its threads) is kept beside it because other jobs on a shared
    machine stretch wall time but hardly the CPU work a step needs.
    """
    times: list[float] = []
    cpu_times: list[float] = []
    previous, previous_cpu = time.perf_counter(), time.process_time()
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        now, now_cpu = time.perf_counter(), time.process_time()
        if i >= warmup:
            times.append(now - previous)
            cpu_times.append(now_cpu - previous_cpu)
        previous, previous_cpu = now, now_cpu
    return times, cpu_times


def write_result(path: str, payload: dict[str, Any]) -> None:
    """Write atomically, so the driver never reads half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)
