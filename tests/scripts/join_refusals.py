"""lite.join refuses what torch's Join cannot survive; broadcast from a joined rank raises.

argv: case   (zero | static_graph | broadcast_from_joined | raw_collective | abort | unmirrorable)
"""

import sys

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

import scopedlite as lite
from _common import make_model, write

case = sys.argv[1]
result = {}
strategy = "fsdp" if case == "unmirrorable" else lite.DDPStrategy(static_graph=case == "static_graph")
with lite.launch(
    strategy=strategy, devices=2, accelerator="cpu", timeout=300
) as run:  # a hang: the test's 90 s kill, long before
    model = make_model()
    if case == "zero":
        model = lite.setup(model)
        opt = lite.setup_optimizers(ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1))
    else:
        model = lite.setup(model)
    if case == "unmirrorable":  # tensors of another shape on each running rank, inside lite.join
        mine = torch.arange(2.0 + run.global_rank)
        loader = lite.setup_dataloader(torch.utils.data.DataLoader(torch.arange(8.0), batch_size=2))
        for name, batches, call in (
            ("loader_gather", loader, lite.all_gather),  # every rank has data: free running
            ("loader_reduce", loader, lite.all_reduce),
            ("list_gather", [0, 1], lite.all_gather),  # a plain loop: the session's rounds
            ("list_reduce", [0, 1], lite.all_reduce),
        ):
            try:
                with lite.join(model):
                    for _ in batches:
                        call(mine)
                result[f"{run.global_rank}:{name}"] = "no error"
            except (ValueError, RuntimeError) as e:
                result[f"{run.global_rank}:{name}"] = f"{type(e).__name__}: {e}"
        result["after"] = lite.all_reduce(1.0)  # the run goes on, in step
    if case == "unmirrorable":  # DTensor collectives of torch's, called by the user inside lite.join (fsdp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for name, call in (
            ("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),  # as nanoGPT
            (
                "total",
                lambda: torch.nn.utils.get_total_norm(tensors=[p.grad for p in model.parameters()]),
            ),  # by keyword
            ("full", lambda: next(model.parameters()).full_tensor()),
            ("norms", lambda: float(sum(p.norm() ** 2 for p in model.parameters()))),  # a weight norm to log
        ):
            try:
                with lite.join(model):
                    for _ in range(3 if run.global_rank == 0 else 1):  # rank 1 runs out first
                        lite.backward(model(torch.randn(4, 4)).sum())
                        call()
                        opt.step()
                        opt.zero_grad()
                result[f"{run.global_rank}:{name}"] = "no error"
            except RuntimeError as e:
                result[f"{run.global_rank}:{name}"] = f"{type(e).__name__}: {e}"
        try:  # a DTensor handed to our collectives: which part to send is the user's to say
            lite.all_reduce(next(model.parameters()))
            result[f"{run.global_rank}:dtensor"] = "no error"
        except TypeError as e:
            result[f"{run.global_rank}:dtensor"] = f"{type(e).__name__}: {e}"
        outside = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # outside the block: as torch
        result["after"] = float(lite.all_reduce(outside.full_tensor() if hasattr(outside, "full_tensor") else outside))
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
        # Both ranks run (no rank serves: lean rounds, not waited for); rank 1 fails
        # in its second step, before or after its backward.
        lean = make_model()
        lean, lean_opt = lite.setup(lean, torch.optim.SGD(lean.parameters(), lr=0.1))
        for where in ("before_backward", "after_backward"):
            try:
                with lite.join(lean):
                    for step in range(3):
                        loss = lean(torch.randn(4, 4)).sum()
                        if run.global_rank == 1 and step == 1 and where == "before_backward":
                            raise KeyError("rank 1 fails before its backward")
                        lite.backward(loss)
                        if run.global_rank == 1 and step == 1 and where == "after_backward":
                            raise KeyError("rank 1 fails after its backward")
                        lean_opt.step()
                        lean_opt.zero_grad()
                outcome = "no error"
            except (KeyError, RuntimeError) as e:
                outcome = f"{type(e).__name__}: {e}"
            lean_opt.zero_grad()
            result[where] = {"error": outcome, "after": lite.all_reduce(float(run.global_rank + 1))}
    everyone = [lite.broadcast(result, src=r) for r in range(run.world_size)]
    if run.is_global_zero:
        write(everyone)
