"""``lite.save`` / ``lite.load`` on rank 0 alone (argv: strategy: ddp, fsdp or
deepspeed_stage_1/2/3), as a torchrun script writes its saving (``if run.is_global_zero:
lite.save(...)``): refused at once on rank 0, which catches it; the ranks stay in step, the
training equals plain torch's, and a save and load on every rank afterwards round-trip. The
same for ``lite.setup`` of another model and ``lite.setup_dataloader`` of a loader to shard on
rank 0 alone (a loader it reads whole, ``use_distributed_sampler=False``, needs no other rank).

Before, rank 0's path check (a collective) met rank 1's next forward (fsdp, ZeRO-3) or
backward (ddp, ZeRO-1/2): the run waited until the hang watchdog or the collective timeout
ended it, or gloo aborted the process on the mismatched sizes.
"""

import os
import sys
import tempfile

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, write

strategy = sys.argv[1]
LR = 0.1


def batches(rank):
    g = torch.Generator().manual_seed(30 + rank)
    return [torch.randn(4, 4, generator=g) for _ in range(4)]


def whole(model):
    """The full parameters (every rank calls it: it gathers)."""
    if strategy == "fsdp":
        return [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]
    return [v.flatten().tolist() for v in model.state_dict().values()]


out = {"refused": []}
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=120) as run:
    rank = run.global_rank
    folder = lite.broadcast(tempfile.mkdtemp() if rank == 0 else None, src=0)
    path = os.path.join(folder, "ckpt")
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    for i, x in enumerate(batches(rank)):
        lite.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        if rank == 0 and i in (1, 2):  # rank 0 alone
            calls = {
                1: [lambda: lite.save(path, {"model": model}), lambda: lite.setup(make_model(seed=3))],
                2: [
                    lambda: lite.load(path, {"model": model}),
                    lambda: lite.setup_dataloader(torch.utils.data.DataLoader(list(batches(0)), batch_size=2)),
                ],
            }
            for call in calls[i]:
                try:
                    call()
                except lite.MethodCalledOnSomeRanksError as e:
                    out["refused"].append(str(e))
            # a loader that rank 0 reads whole: no other rank needed
            alone = lite.setup_dataloader(
                torch.utils.data.DataLoader(list(batches(0)), batch_size=2), use_distributed_sampler=False
            )
            out["read_alone"] = sum(len(b) for b in alone)
    out["trained"] = whole(model)
    lite.save(path, {"model": model, "opt": opt})  # every rank: fine
    fresh = make_model(seed=7)
    model2, opt2 = lite.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=LR))
    lite.load(path, {"model": model2, "opt": opt2})
    out["loaded"] = whole(model2)
    seen = from_every_rank(out)
    if rank == 0:
        write(seen)
