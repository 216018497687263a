"""A method of a submodule that is its own FSDP unit, called from the model's forward and from
outside, trains as one process does (tests/test_one_script.py imports the model from here).
argv: strategy ("ddp" or "fsdp", which wraps each Block)."""

import sys

import torch

import scopedlite as lite
from _common import write


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))

    def attend(self, x: torch.Tensor) -> torch.Tensor:  # not forward: FSDP2 gathers for forward only
        return self.lin(x) * 0.5


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block.attend(x))


def rank_batch(rank: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))


def step_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean() + model.block.attend(x).pow(2).mean()


def main() -> None:
    strategy = lite.FSDPStrategy(auto_wrap_policy={Block}) if sys.argv[1] == "fsdp" else sys.argv[1]
    with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
        torch.manual_seed(0)
        net = Net()
        model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x = rank_batch(run.global_rank)
        for _ in range(2):
            lite.backward(step_loss(model, x))
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            outputs = lite.all_gather(model.block.attend(x)).flatten().tolist()
        if run.is_global_zero:
            write({"outputs": outputs})


if __name__ == "__main__":
    main()
