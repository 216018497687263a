"""Join whatever world the environment describes; rank 0 writes what every rank saw.

argv: none. Writes {"source", "sum", "ranks": [{rank, local_rank, node_rank, pid, children}]}.
"""

import os

import psutil
import torch
from _common import write

import scopedlite as lite
from scopedlite._cluster.environments import detect_world

world = detect_world(os.environ)
with lite.launch(accelerator="cpu", timeout=60) as run:
    total = lite.all_reduce(run.global_rank + 1)
    me = [run.global_rank, run.local_rank, run.node_rank, os.getpid(), len(psutil.Process().children())]
    everyone = lite.all_gather(torch.tensor(me)).tolist()
    if run.is_global_zero:
        write({
            "source": world.source if world else None,
            "world_size": run.world_size,
            "sum": total,
            "ranks": [dict(zip(["rank", "local_rank", "node_rank", "pid", "children"], r)) for r in everyone],
        })
