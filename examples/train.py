"""Train a small classifier on synthetic data: DDP on 2 CPU processes by default.

    python examples/train.py                      # 2 processes, DDP, CPU
    python examples/train.py --devices 1          # one process
    python examples/train.py --precision bf16-mixed --epochs 5

The loop is plain PyTorch; scopedlite's scopes and functions are the only additions.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import scopedlite as lite


def make_data(n: int = 4096, features: int = 32, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w).argmax(dim=1)  # a learnable rule: the loss must fall
    return TensorDataset(x, y)


class Net(torch.nn.Module):
    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint", default=None, help="where to save the final state")
    args = parser.parse_args()
    if args.devices == 1 and args.strategy == "ddp":
        args.strategy = "auto"

    start = time.perf_counter()
    with lite.launch(
        strategy=args.strategy, devices=args.devices, accelerator=args.accelerator, precision=args.precision
    ) as run:
        lite.seed_everything(42)
        with lite.sharded_init():
            model = Net()
        model, opt = lite.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        loader = lite.setup_dataloader(DataLoader(make_data(), batch_size=args.batch_size, shuffle=True))
        lite.print(f"{run.world_size} process(es) on {run.device}, {len(loader)} batches per epoch per rank")

        for epoch in range(args.epochs):
            total, count = 0.0, 0
            with lite.join(model):
                for x, y in loader:
                    with lite.autocast():
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                    lite.backward(loss)
                    opt.step()
                    opt.zero_grad()
                    total += loss.item() * len(y)
                    count += len(y)
            mean = lite.all_reduce(total) / lite.all_reduce(count)
            lite.print(f"epoch {epoch}: loss {mean:.4f}")
        if args.checkpoint:
            lite.save(args.checkpoint, {"model": model, "opt": opt, "epochs": args.epochs})
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
