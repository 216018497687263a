"""An optimizer holding a parameter that no set-up model holds is refused on every rank.

Under ddp such a parameter's gradient is not averaged (each rank would train its own copy,
and the copies drift apart without a word): refused at the first step that would train it.
Under fsdp and DeepSpeed it is refused when set up (DeepSpeed failed inside
deepspeed.initialize with a KeyError or AttributeError). Cases:

- ``free_parameter``: a free-standing parameter (a CLIP-style logit scale) in the loss, beside
  the model's: refused everywhere;
- ``set_up_later``: one optimizer over two models, set up with the first, the second set up
  after: trains under ddp (fsdp swaps each parameter for its shard when the optimizer is set
  up, so its models come first; DeepSpeed takes one model per optimizer);
- then the run goes on: every rank reaches the next collective.

argv: strategy
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, write

strategy = sys.argv[1]
X = torch.ones(2, 4)


def refused(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def free_parameter():
    net, scale = make_model(), torch.nn.Parameter(torch.ones(()))
    model, opt = lite.setup(net, torch.optim.SGD([*net.parameters(), scale], lr=0.1))
    lite.backward((model(X) * scale).sum())
    opt.step()


def set_up_later():
    first, second = make_model(), make_model(1)
    first, opt = lite.setup(first, torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1))
    second = lite.setup(second)
    lite.backward(first(X).sum() + second(X).sum())
    opt.step()
    return [float(p.detach().sum()) for p in second.parameters()][-1]


with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    out = {"free_parameter": refused(free_parameter)}
    if strategy == "ddp":
        out["set_up_later"] = set_up_later()
    out["went_on"] = lite.all_reduce(1, op="sum")
    seen = from_every_rank(out)
    if run.is_global_zero:
        write(seen)
