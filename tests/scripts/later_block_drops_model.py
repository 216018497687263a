"""Later forked launch blocks whose workers drop the DDP model an earlier block left behind.

A notebook does this: a cell trains in a launch block and keeps `model`; the next cell's block
assigns `model` again, and every forked worker drops its copy of the old one (whose reducer
holds the earlier run's gloo group). Rank 0 writes each block's all_reduce.
"""

import torch
from _common import make_model, write

import scopedlite as lite

totals = []
for block in range(3):
    with lite.launch(strategy="ddp", devices=2, accelerator="cpu", launcher="fork", timeout=60) as run:
        model = lite.setup(make_model())  # a worker drops the previous block's model here
        out = model(torch.ones(2, 4)).sum()
        lite.backward(out)
        total = lite.all_reduce(torch.tensor(float(run.global_rank + 1))).item()
    totals.append(total)
write(totals)
