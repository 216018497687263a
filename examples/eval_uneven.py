"""Evaluate a model on 10 samples over 3 processes: padding gives a wrong mean, `join` the exact one.

    python examples/eval_uneven.py                # 3 processes, DDP, CPU
    python examples/eval_uneven.py --devices 4

10 samples do not divide by 3 ranks. Outside `lite.join`, the sampler that `setup_dataloader`
inserts pads the shorter ranks by repeating samples (as `DistributedSampler` does), so every
rank runs the same number of batches, but two samples are counted twice and the mean is off.
Inside `with lite.join(model):` each rank reads its own samples exactly once, ranks may run
out of data at different times, and the mean equals the one-process value.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import scopedlite as lite


def make_data(n: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + torch.arange(n, dtype=torch.float32).unsqueeze(1)  # samples differ a lot
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights in every process and in the reference
    return torch.nn.Linear(4, 1)


def mean_loss(model: torch.nn.Module, loader: DataLoader) -> float:
    """Mean squared error over every sample this rank reads, then summed over the ranks."""
    total, count = 0.0, 0
    for x, y in loader:
        total += torch.nn.functional.mse_loss(model(x), y, reduction="sum").item()
        count += len(x)
    total, count = lite.all_reduce([total, count])  # inside join: over the ranks still active
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--samples", type=int, default=10)
    args = parser.parse_args()

    data = make_data(args.samples)
    with torch.no_grad():  # the one-process value: every sample exactly once
        x, y = data.tensors
        reference = torch.nn.functional.mse_loss(make_model()(x), y).item()

    with lite.launch(strategy="ddp", devices=args.devices, accelerator="cpu") as run:
        model = lite.setup(make_model())
        loader = lite.setup_dataloader(DataLoader(data, batch_size=2))
        model.eval()

        with torch.no_grad():
            padded = mean_loss(model, loader)  # outside join: padded, 2 samples counted twice

        with torch.no_grad(), lite.join(model):
            exact = mean_loss(model, loader)  # inside join: each sample once, uneven ranks

        lite.print(f"{args.samples} samples on {run.world_size} ranks")
        lite.print(f"padded sampler, no join: mean loss {padded:.6f}")
        lite.print(f"with lite.join(model):   mean loss {exact:.6f}")
        lite.print(f"one process:             mean loss {reference:.6f}")


if __name__ == "__main__":
    main()
