"""lite.join refuses what torch's Join cannot survive; broadcast from a joined rank raises.

argv: case   (zero | static_graph | broadcast_from_joined | raw_collective | abort)
"""

import sys

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

import scopedlite as lite
from _common import make_model, write

case = sys.argv[1]
result = {}
with lite.launch(strategy=lite.DDPStrategy(static_graph=case == "static_graph"), devices=2, accelerator="cpu", timeout=300) as run:  # a hang: the test's 90 s kill, long before
    model = make_model()
    if case == "zero":
        model = lite.setup(model)
        opt = lite.setup_optimizers(ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1))
    else:
        model = lite.setup(model)
    try:
        with lite.join(model):
            if case == "broadcast_from_joined":
                for _ in range(3 if run.global_rank == 0 else 1):
                    lite.broadcast("hi" if run.global_rank == 1 else None, src=1)
            if case == "abort":  # rank 0 fails after rank 1 ran out of data
                for step in range(3 if run.global_rank == 0 else 1):
                    lite.all_reduce(1.0)
                    if step == 2:
                        raise KeyError("rank 0 fails inside join")
            if case == "raw_collective":  # as torchmetrics' compute() does, once rank 1 is done
                for step in range(3 if run.global_rank == 0 else 1):
                    lite.all_reduce(1.0)
                    if step == 2:
                        torch.distributed.all_reduce(torch.ones(1))
        result[run.global_rank] = "no error"
    except (ValueError, RuntimeError) as e:
        if case in ("broadcast_from_joined", "raw_collective"):
            raise  # the run must end with this error, not hang
        result[run.global_rank] = f"{type(e).__name__}: {e}"
    except KeyError as e:  # caught outside the join block: the run goes on, in step
        result[run.global_rank] = f"{type(e).__name__}: {e}"
    if case == "abort":
        result["after"] = lite.all_reduce(20.0)
    everyone = [lite.broadcast(result, src=r) for r in range(run.world_size)]
    if run.is_global_zero:
        write(everyone)
