"""An optimizer holding a parameter that no set-up model holds is refused on every rank.

Under ddp such a parameter's gradient is not averaged (each rank would train its own copy,
and the copies drift apart without a word), and DeepSpeed failed inside deepspeed.initialize
with a KeyError or AttributeError. Two cases: an optimizer built on another instance of the
model, and a free-standing parameter (a CLIP-style logit scale) beside the model's. Then the
run goes on: the model set up with its own optimizer trains one step on every rank.

argv: strategy
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, write


def refused(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


with lite.launch(strategy=sys.argv[1], devices=2, accelerator="cpu", timeout=60) as run:
    scale = torch.nn.Parameter(torch.ones(()))
    other = make_model()
    out = {
        "another_model": refused(lambda: lite.setup(make_model(), torch.optim.SGD(other.parameters(), lr=0.1))),
    }
    net = make_model()
    out["free_parameter"] = refused(lambda: lite.setup(net, torch.optim.SGD([*net.parameters(), scale], lr=0.1)))
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    lite.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    out["trained"] = lite.all_reduce(1, op="sum")
    seen = from_every_rank(out)
    if run.is_global_zero:
        write(seen)
