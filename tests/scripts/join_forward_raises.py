"""A forward that raises midway on one rank inside lite.join, where forwards gather parameters
(argv: strategy, then how the script takes it: ``uncaught``, ``inside`` the block (the loop
goes on to its next batch) or ``outside`` it (the script goes on to a collective)).

The other rank is then inside that forward's gathers (rank 1 raised between two of them). The
join protocol's abort round used to be sent anyway: it met the other rank's all-gather, and
gloo aborted the process (SIGABRT: the user's error was lost; under NCCL a hang). Now the run
ends with the forward's own error where nothing catches it, and where the script catches it
this rank's next step raises "cannot go on", which ends the run too. Before it, two steps in
the block train as usual.
"""

import sys

import torch

import scopedlite as lite


class Layers(torch.nn.Module):
    """Three linear layers, each its own FSDP unit (gathered in turn)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x, fail=False):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if fail and i == 1:
                raise KeyError("rank 1 fails inside its forward")
        return x


strategy, catch = sys.argv[1], sys.argv[2]
chosen = lite.FSDPStrategy(auto_wrap_policy={torch.nn.Linear}) if strategy == "fsdp" else strategy
with lite.launch(strategy=chosen, devices=2, accelerator="cpu", timeout=60) as run:
    torch.manual_seed(0)
    net = Layers()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        with lite.join(model):
            for step in range(4):
                fail = run.global_rank == 1 and step == 2
                try:
                    loss = model(torch.randn(4, 8), fail=fail).sum()
                except KeyError:
                    if catch == "inside":
                        continue
                    raise
                lite.backward(loss)
                opt.step()
                opt.zero_grad()
    except KeyError:
        if catch != "outside":
            raise
    lite.all_reduce(1.0)
    raise AssertionError("the run went on after a forward raised on one rank")
