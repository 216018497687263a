"""A method of a submodule that is its own FSDP unit, called from the model's forward and from
outside, trains as one process does (tests/test_one_script.py imports the model from here);
the set-up model's and unit's classes, and a set-up Sequential indexed into and its method.
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


class Stack(torch.nn.Sequential):
    """A container the user indexes into: under FSDP2 ``stack[:1]`` builds a plain ``Stack``,
    calling its ``__init__`` once (counted: an init may draw random numbers)."""

    inits = 0

    def __init__(self, *args: torch.nn.Module) -> None:
        super().__init__(*args)
        Stack.inits += 1

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self[0](x)


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
        # the set-up model and its unit keep FSDP2's class names and the user's classes
        classes = [type(model).__name__, isinstance(model, Net), type(model.block).__name__]
        classes.append(isinstance(model.block, Block))
        torch.manual_seed(1)
        stack = lite.setup(Stack(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
        before = Stack.inits
        sliced = [type(stack[:1]).__name__, Stack.inits - before]  # FSDPModule.__new__ finds the original class
        first = lite.all_gather(stack.first(x).detach()).flatten().tolist()
        if run.is_global_zero:
            write({"outputs": outputs, "classes": classes, "sliced": sliced, "first": first})


if __name__ == "__main__":
    main()
