"""SIGTERM to the main process: the loop notices lite.should_stop(), saves, and leaves.

argv: steps_before_ready  (rank 0 writes a 'ready' mark then keeps stepping)
"""

import os
import time

import torch

import scopedlite as lite
from _common import make_data, make_model, write

out = os.environ["OUT"]
with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
    with open(f"{out}.pid{run.global_rank}", "w") as f:
        f.write(str(os.getpid()))
    model = lite.setup(make_model())
    opt = lite.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = make_data(8).tensors
    step = 0
    while step < 100000:
        lite.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 5 and run.is_global_zero:
            open(f"{out}.ready", "w").close()
        time.sleep(0.01)
        if lite.should_stop():
            lite.save(f"{out}.ckpt", {"model": model, "step": step})
            break
    steps = lite.all_gather(step).tolist()
if True:
    write({"steps": steps, "saved": os.path.exists(f"{out}.ckpt")})
