"""Gradient accumulation under DDP: all-reduce the gradients once per optimizer step, not per micro-batch.

    python examples/accumulate.py                 # 2 processes, 4 micro-batches per step
    python examples/accumulate.py --accumulate 8

Each rank runs `--accumulate` micro-batches per optimizer step. Every backward but the last is
run inside `lite.no_backward_sync(model, enabled=True)`: gradients add up locally and no
all-reduce happens. The last one runs with `enabled=False` and all-reduces the accumulated sum.
The example checks two things and prints them:

- inside the scope gradients really stay local (they differ between the ranks);
- the trained weights equal one process taking one step per big batch of
  (ranks x accumulate x micro-batch) samples.
"""

from __future__ import annotations

import argparse
import copy

import torch

import scopedlite as lite


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one optimizer step: the same in every process (seeded by step)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 16, generator=g)
    return x, x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    with lite.launch(strategy="ddp", devices=args.devices, accelerator="cpu") as run:
        plain = make_model()
        reference = copy.deepcopy(plain)  # trained below on the whole big batch, in this process only
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        model, opt = lite.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))

        world, micro, accumulate = run.world_size, args.micro_batch, args.accumulate
        stayed_local = None
        for step in range(args.steps):
            x, y = batch(step, world * accumulate * micro)
            mine_x, mine_y = x[run.global_rank :: world], y[run.global_rank :: world]  # this rank's share
            total = 0.0
            for i in range(accumulate):
                last = i == accumulate - 1
                xb, yb = mine_x[i * micro : (i + 1) * micro], mine_y[i * micro : (i + 1) * micro]
                with lite.no_backward_sync(model, enabled=not last):  # sync only on the last micro-batch
                    loss = torch.nn.functional.mse_loss(model(xb), yb) / accumulate
                    lite.backward(loss)
                total += loss.item()
                if step == 0 and i == 0:  # gradients after one unsynced backward: still local?
                    grads = lite.all_gather(next(model.parameters()).grad)
                    stayed_local = not all(torch.equal(grads[0], g) for g in grads[1:])
            opt.step()
            opt.zero_grad()

            ref_opt.zero_grad()  # one process, one step on the whole batch: the same mean loss
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()

            if step % 10 == 0 or step == args.steps - 1:
                lite.print(f"step {step}: loss {lite.all_reduce(total, op='mean'):.4f}")

        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        diff = lite.all_reduce(diff, op="max")
        lite.print(f"{world} process(es), {accumulate} micro-batches of {micro} per step")
        lite.print(f"gradients stayed local inside no_backward_sync: {stayed_local}")
        lite.print(f"max difference from one process on the big batch: {diff:.2e}")


if __name__ == "__main__":
    main()
