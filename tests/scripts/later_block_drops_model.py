"""Later forked launch blocks whose workers drop the model an earlier block left behind.

A notebook does this: a cell trains in a launch block and keeps `model`; the next cell's block
assigns `model` again, and every forked worker drops its copy of the old one (a DDP reducer or
a DeepSpeed engine holding the earlier run's gloo groups). Rank 0 writes each block's
all_reduce.

argv: strategy
"""

import sys

import torch

import scopedlite as lite
from _common import make_model, write

totals = []
for _block in range(3):
    with lite.launch(strategy=sys.argv[1], devices=2, accelerator="cpu", launcher="fork", timeout=60) as run:
        net = make_model()
        model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))  # a worker drops the last ones
        lite.backward(model(torch.ones(2, 4)).sum())
        opt.step()
        total = lite.all_reduce(torch.tensor(float(run.global_rank + 1))).item()
    totals.append(total)
write(totals)
