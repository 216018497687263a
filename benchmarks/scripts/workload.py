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
) -> list[float]:
    """Run one pass over ``loader`` and return the duration of each step after ``warmup``.

    A step is measured from the end of the previous one to the end of this one, so the time
    to fetch the batch (sampler, collate, the loader wrappers of each library) is included.
    """
    times: list[float] = []
    previous = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        backward(loss)
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - previous)
        previous = now
    return times


def write_result(path: str, payload: dict[str, Any]) -> None:
    """Write atomically, so the driver never reads half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)
