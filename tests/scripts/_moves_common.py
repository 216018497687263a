"""The model, optimizer and data of tests/test_checkpoint_moves.py, shared by its script and
its one-process plain-torch reference."""

from __future__ import annotations

import torch

N, BATCH, SEED = 24, 4, 11  # 24 samples, 4 per rank and step: 6, 3 or 2 steps per epoch


class Net(torch.nn.Module):
    """Sizes that no world size divides evenly (FSDP and ZeRO-3 pad and cut unevenly), a
    one-row layer (empty shards on some ranks), and a buffer the checkpoint must carry."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 1)
        self.register_buffer("shift", torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) + self.shift


def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over two param groups with their own hyper-parameters."""
    weights, biases = [model.a.weight, model.b.weight], [model.a.bias, model.b.bias]
    return torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 0.03}], lr=0.02
    )


def make_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(N, 5, generator=g), torch.randn(N, 1, generator=g))


def sampler(data: torch.utils.data.Dataset, world_size: int, rank: int) -> torch.utils.data.DistributedSampler:
    """A script ported from torchrun builds its own sampler for its rank (on one process too)."""
    return torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)


class Big(torch.nn.Module):
    """Eight 4 MB parameters (32 MB; 96 MB with AdamW's moments)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x
