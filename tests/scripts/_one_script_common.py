"""The model, data and loss of tests/scripts/one_script.py, shared with its one-process
reference in tests/test_one_script.py (plain torch, whole batches)."""

from __future__ import annotations

import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 1)
        self.temperature = torch.nn.Parameter(torch.tensor([1.5]))  # the root's own (FSDP2 refuses 0-d)
        self.register_buffer("offset", torch.tensor([0.1]))
        self.gain = 0.5  # a plain attribute

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)) * self.gain + self.offset

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """The training output: forward, then a root parameter."""
        return self.forward(x) * self.temperature

    def current_gain(self) -> float:
        return self.gain

    def describe(self) -> str:
        return f"Net(gain={self.gain})"


class WithConfig(Net):
    def __init__(self) -> None:
        super().__init__()
        self.config = {"depth": 2}


def build(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 rows of step ``step``; rank r of 2 takes rows ``r::2``."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=g)
    return x, y


def probe() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(7))


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model.score(x), y)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
