"""Ranks call different collectives; with SCOPEDLITE_DEBUG=1 every rank raises, naming each.

argv: case (shape | op | kind | join)
"""

import sys

import torch

import scopedlite as lite
from _common import make_model, write

case = sys.argv[1]
with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=30) as run:
    r = run.global_rank
    message = "no error"
    try:
        if case == "shape":
            lite.all_reduce(torch.ones(2 + r))
        elif case == "op":
            lite.all_reduce(torch.ones(2), op="sum" if r == 0 else "max")
        elif case == "kind":
            if r == 0:
                lite.all_reduce(torch.ones(2))
            else:
                lite.broadcast(torch.ones(2))
        elif case == "join":
            model = lite.setup(make_model())
            with lite.join(model):
                lite.all_gather(torch.ones(1 + r))
        else:
            lite.all_reduce(torch.ones(2))  # the same everywhere: no error
    except lite.CollectiveMismatchError as e:
        message = str(e)
    everyone = [lite.broadcast(message, src=i) for i in range(run.world_size)]
    if r == 0:
        write(everyone)
