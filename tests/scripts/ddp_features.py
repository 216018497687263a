"""DDP: accumulation with no_backward_sync, clipping, save/load, rank_zero_first, bf16-mixed,
and the error for a layer the loss does not use.

Rank 0 writes the results; the test compares them with one process.
"""

import os
import sys
import time

import torch

import scopedlite as lite
from _common import make_data, make_model, params, write

ckpt = sys.argv[1]
with lite.launch(strategy="ddp", devices=2, accelerator="cpu", precision="bf16-mixed", timeout=60) as run:
    model = make_model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = make_data(16)
    x, y = data.tensors
    # rank r takes rows r::2; two micro-batches of 4 per rank, one optimizer step
    mine_x, mine_y = x[run.global_rank :: 2], y[run.global_rank :: 2]
    for micro in range(2):
        sl = slice(4 * micro, 4 * micro + 4)
        with lite.no_backward_sync(model, enabled=micro == 0):
            loss = torch.nn.functional.mse_loss(model(mine_x[sl]), mine_y[sl]) / 2
            lite.backward(loss)
    norm_inf = lite.clip_gradients(model, opt, max_norm=1e9, norm_type="inf")  # no-op clip: only the norm
    norm_1 = lite.clip_gradients(model, opt, max_norm=1e9, norm_type=1.0)
    norm = lite.clip_gradients(model, opt, max_norm=1e9)
    opt.step()
    opt.zero_grad()
    after_step = params(lite.current().strategy.unwrap(model))

    with lite.autocast():
        dtype = str(model(x).dtype)

    lite.save(ckpt, {"model": model, "opt": opt, "step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    rest = lite.load(ckpt, {"model": model, "opt": opt})
    restored = params(lite.current().strategy.unwrap(model)) == after_step

    order = lite.all_gather(torch.tensor(0.0))  # placeholder so both ranks reach here
    marker = ckpt + ".prepared"  # what rank 0 prepares first (a download): the others must find it
    with lite.rank_zero_first() as first:
        found = os.path.exists(marker)
        if first:
            time.sleep(0.5)  # a rank let in early would look before the file is there
            with open(marker, "w") as f:
                f.write("prepared")
    everyone = [lite.broadcast({"first": first, "found": found}, src=r) for r in range(run.world_size)]

    # a layer the loss never uses, under plain "ddp": the next forward names it, and our line
    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.frozen = torch.nn.Linear(3, 3).requires_grad_(False)  # not counted by DDP's indices
            self.head = torch.nn.Linear(3, 1)
            self.unused = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.head(self.frozen(self.a(x)))

    unused = lite.setup(WithUnused())
    error = None
    try:
        for _ in range(2):
            lite.backward(unused(torch.ones(2, 3)).sum())
    except RuntimeError as e:
        error = {"message": str(e), "cause": str(e.__cause__)}
    errors = [lite.broadcast(error, src=r) for r in range(run.world_size)]
    result = {
        "params": after_step,
        "norm": float(norm),
        "norm_inf": float(norm_inf),
        "norm_1": float(norm_1),
        "dtype": dtype,
        "restored": restored,
        "rest": rest,
        "rank_zero_first": everyone,
        "restored_all": lite.all_reduce(int(restored), op="min"),
        "unused_errors": errors,
    }
    if run.is_global_zero:
        write(result)
