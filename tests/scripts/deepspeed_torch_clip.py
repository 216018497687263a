"""torch's own clipping on a DeepSpeed model (argv: strategy), as a DDP script writes it.

Under DeepSpeed every parameter's .grad is None after lite.backward (the gradients are the
engine's), so ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` used to clip
nothing and return 0.0, silently: the run trained unclipped. Now it clips the engine's full
gradients. Cases:

- ``norm``: three steps with clip_grad_norm_ (a small max_norm: every step clips), each
  returned norm and the parameters compared with plain torch in the test; after the second
  clip rank 0 alone clips again, with clip_grad_norm_ and with lite.clip_gradients (to log a
  norm), while rank 1 goes on to its step: each refused at once, before any gather, so the
  training is unchanged (``alone``);
- ``value``: the same with clip_grad_value_;
- ``part``: clip_grad_norm_ over part of the model's parameters is refused (ValueError);
- ``join``: clip_grad_norm_ inside lite.join is refused on every rank at once, naming
  lite.clip_gradients; the next collective pairs.
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, params, write

strategy = sys.argv[1]
LR, MAX_NORM, CLIP_VALUE = 0.1, 0.05, 0.01


def batches(rank):
    g = torch.Generator().manual_seed(20 + rank)
    return [torch.randn(4, 4, generator=g) * 3 for _ in range(3)]


def train(clip, alone=None):
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    returned = []
    for i, x in enumerate(batches(lite.current().global_rank)):
        lite.backward(model(x).pow(2).mean())
        returned.append(clip(model))
        if alone is not None and i == 1 and lite.current().is_global_zero:
            # rank 0 alone clips once more to log the norm, while rank 1 goes on to its step
            for what, call in (
                ("torch", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)),
                ("lite", lambda: lite.clip_gradients(model, opt, max_norm=MAX_NORM)),
            ):
                try:
                    call()
                except lite.MethodCalledOnSomeRanksError as e:
                    alone[what] = str(e)
        opt.step()
        opt.zero_grad()
    return model, returned


out = {}
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=120) as run:
    rank = run.global_rank
    out["alone"] = {}
    model, norms = train(lambda m: float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)), out["alone"])
    out["norm"] = {"params": params(model), "returned": norms}
    model, returned = train(lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), CLIP_VALUE))
    out["value"] = {"params": params(model), "returned": returned}
    try:
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], MAX_NORM)
        out["part"] = None
    except ValueError as e:
        out["part"] = str(e)
    try:
        with lite.join(model):
            for x in batches(rank):
                lite.backward(model(x).pow(2).mean())
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        out["join"] = None
    except RuntimeError as e:
        out["join"] = str(e)
    out["after"] = float(lite.all_reduce(torch.tensor(float(rank + 1)), op="sum"))
    seen = from_every_rank(out)
    if run.is_global_zero:
        write(seen)
