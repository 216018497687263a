"""Time to the first line inside the parallel region, on every rank.

argv: MODE OUT, MODE one of:
  script   ``lite.launch(strategy="ddp")``: this process is rank 0, rank 1 re-executes the script;
  fork     ``lite.launch(strategy="ddp_fork")``: rank 1 is forked from this process;
  torchrun started by ``python -m torch.distributed.run --nproc-per-node 2``: the first line
           after ``torch.distributed.init_process_group("gloo")``.

Each rank writes ``time.time()`` at its first line to ``OUT.<rank>`` (wall clock, because the
start stamp comes from the driver process). Nothing else runs, so what is timed is the
interpreter start, ``import torch``, starting the other rank and the rendezvous.
"""

from __future__ import annotations

import sys
import time

mode, out = sys.argv[1], sys.argv[2]


def stamp(rank: int) -> None:
    with open(f"{out}.{rank}", "w") as f:
        f.write(repr(time.time()))


if mode == "torchrun":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    stamp(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()
else:
    import scopedlite as lite

    strategy = {"script": "ddp", "fork": "ddp_fork"}[mode]
    with lite.launch(strategy=strategy, devices=2, accelerator="cpu") as run:
        stamp(run.global_rank)
        lite.barrier()
