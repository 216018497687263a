"""Preemptible training: stop cleanly on SIGTERM, and continue exactly where it stopped.

    python examples/resume.py          # trains; `kill -TERM <pid>` makes it save and stop
    python examples/resume.py          # run again: continues from resume-ckpt.pt

SLURM, torchrun and Kubernetes send SIGTERM before they stop a run (see docs/preemption.md
for their commands). On SIGTERM, ``lite.should_stop()`` turns True on every rank at the same
step; the loop saves model, optimizer, loader (its position in the epoch, and the random
states of every rank) and leaves, and the process exits with 143, as a process ended by
SIGTERM does, so that whatever restarts failed runs restarts it. Run again, it loads the
checkpoint and continues with the first batch not yet seen: the result is the one an
uninterrupted run gives, dropout and shuffling included.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import scopedlite as lite

STOPPED = 143  # the exit status of a process ended by SIGTERM (128 + 15)


def make_data(n: int = 512, features: int = 16, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint", default="resume-ckpt.pt")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="pretend each step takes this long")
    args = parser.parse_args()

    stopped = False
    with lite.launch(strategy=args.strategy, devices=args.devices, accelerator="cpu") as run:
        lite.seed_everything(42)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4)
        )
        model, opt = lite.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        loader = lite.setup_dataloader(DataLoader(make_data(), batch_size=32, shuffle=True))
        state = {"model": model, "opt": opt, "loader": loader, "epoch": 0, "step": 0}
        if os.path.exists(args.checkpoint):
            lite.load(args.checkpoint, state)  # the loader continues where it stopped
            lite.print(f"resumed at epoch {state['epoch']}, step {state['step']}")

        while state["epoch"] < args.epochs and not stopped:
            total, count = 0.0, 0
            with lite.join(model):
                for x, y in loader:
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    lite.backward(loss)
                    opt.step()
                    opt.zero_grad()
                    total, count = total + loss.item() * len(y), count + len(y)
                    state["step"] += 1
                    lite.print(f"step {state['step']}", flush=True)
                    time.sleep(args.step_seconds)
                    if lite.should_stop():  # after the step: the batch counts as seen
                        break
            # A rank that ran out of data inside lite.join did not take part in the last
            # should_stop(); asked again outside the block, every rank has the same answer.
            stopped = lite.should_stop()
            if stopped:  # saved outside lite.join, where every rank takes part
                lite.save(args.checkpoint, state)
                lite.print(f"stopped at epoch {state['epoch']}, step {state['step']}: saved {args.checkpoint}")
                break
            mean = lite.all_reduce(total) / max(1, lite.all_reduce(count))
            lite.print(f"epoch {state['epoch']}: loss {mean:.4f}")
            state["epoch"] += 1
        if not stopped:
            lite.print(f"finished after {state['step']} steps on {run.world_size} process(es)")
    if stopped:
        sys.exit(STOPPED)


if __name__ == "__main__":
    main()
