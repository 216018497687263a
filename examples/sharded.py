"""Build a model already sharded, train it on 2 processes, save it, and read it back in one process.

    python examples/sharded.py                              # FSDP (FSDP2), 2 CPU processes
    python examples/sharded.py --strategy deepspeed_stage_3 # DeepSpeed ZeRO-3 (pip install scopedlite[deepspeed])

`with lite.sharded_init():` builds the model without ever holding all of it in one process,
with the values a plain build with the same seed gives it: the build is recorded on the meta
device, then each parameter is computed on its own and only this rank's part is kept (under
FSDP by `lite.setup`, under DeepSpeed ZeRO-3 as the block closes). Each rank holds about half
of every parameter, printed below. The loop runs inside `lite.join`, as under DDP: the ranks
hold different numbers of batches and every sample is read once. `lite.save` writes a folder
with one shard per rank; after the block, one process loads that folder into a plain model, as
it is (no conversion step), and checks its loss against the loss measured inside the run.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import scopedlite as lite

STRATEGIES = ("fsdp", "deepspeed_stage_3")


def make_data(n: int = 449) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :4].sum(dim=1, keepdim=True) / 2))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def local_and_full(model: torch.nn.Module) -> tuple[int, int]:
    """Parameter elements this rank stores, and elements of the whole model."""
    local = full = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3: a partitioned parameter
            local, full = local + p.ds_tensor.numel(), full + p.ds_numel
        elif hasattr(p, "to_local"):  # FSDP2: a sharded DTensor
            local, full = local + p.to_local().numel(), full + p.numel()
        else:
            local, full = local + p.numel(), full + p.numel()
    return local, full


def full_loss(model: torch.nn.Module, data: TensorDataset) -> float:
    """Loss on the whole data set (every rank runs the same forward: FSDP/ZeRO-3 need that)."""
    x, y = data.tensors
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp", choices=STRATEGIES)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--checkpoint", default="sharded-ckpt", help="folder lite.save writes")
    args = parser.parse_args()

    data = make_data()
    with lite.launch(strategy=args.strategy, devices=2, accelerator="cpu") as run:
        lite.seed_everything(0)
        with lite.sharded_init():  # never the whole model in one process
            model = Net()
        model, opt = lite.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        local, full = local_and_full(model)
        print(f"rank {run.global_rank} holds {local} of {full} parameter elements", flush=True)

        loader = lite.setup_dataloader(DataLoader(data, batch_size=32, shuffle=True))
        lite.print(f"epoch -1: loss {full_loss(model, data):.4f}")
        for epoch in range(args.epochs):
            # 449 samples in batches of 32: 225 on rank 0 (8 batches), 224 on rank 1 (7). Inside
            # join rank 1 serves rank 0's last step (a zero-weighted replay of the forward and
            # backward, and the optimizer step), so every sample counts once.
            with lite.join(model):
                for x, y in loader:
                    lite.backward(torch.nn.functional.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
            lite.print(f"epoch {epoch}: loss {full_loss(model, data):.4f}")
        final = full_loss(model, data)
        lite.save(args.checkpoint, {"model": model, "opt": opt, "epochs": args.epochs})  # a folder: one shard per rank

    # After the block: one process. The folder loads into a plain model as it is (for one
    # file of it, lite.consolidate_checkpoint(args.checkpoint, "model.pt")).
    plain = Net()
    rest = lite.load(args.checkpoint, {"model": plain})
    assert rest == {"epochs": args.epochs}
    print(
        f"saved to {args.checkpoint}/; plain model loaded from it: loss {full_loss(plain, data):.6f} "
        f"(in the run: {final:.6f})"
    )


if __name__ == "__main__":
    main()
