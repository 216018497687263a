"""Join whatever world the environment describes; rank 0 writes what every rank saw.

argv: none. Writes {"source", "sum", "ranks": [{rank, local_rank, node_rank, pid, children}],
"threads_let_go"}: the OS threads rank 0 ends when, at its exit, it lets go of the groups its run
retired (the gloo groups' worker threads: freed while the interpreter still runs).
"""

import os

import psutil
import torch

import scopedlite as lite
from _common import write
from scopedlite._cluster.environments import detect_world
from scopedlite._comm.distributed import _let_go_at_exit

world = detect_world(os.environ)
with lite.launch(accelerator="cpu", timeout=60) as run:
    total = lite.all_reduce(run.global_rank + 1)
    me = [run.global_rank, run.local_rank, run.node_rank, os.getpid(), len(psutil.Process().children())]
    everyone = lite.all_gather(torch.tensor(me)).tolist()
    record = {
        "source": world.source if world else None,
        "world_size": run.world_size,
        "sum": total,
        "ranks": [dict(zip(["rank", "local_rank", "node_rank", "pid", "children"], r)) for r in everyone],
    }
    rank = run.global_rank
threads = psutil.Process().num_threads()
_let_go_at_exit()  # what atexit runs: early here, to count what it ends
if rank == 0:
    write({**record, "threads_let_go": threads - psutil.Process().num_threads()})
