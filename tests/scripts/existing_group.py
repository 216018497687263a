"""An unchanged lite loop in a process whose default process group exists before launch.

:func:`loop` is what a Ray Train worker runs (tests/scripts/ray_train.py) and what this file
runs as a script: setup, setup_dataloader, join over uneven data (9 samples on 2 ranks:
3 batches and 2), save, and load into a fresh model. Rank r writes
``<out_dir>/<strategy>.rank<r>.json``.

As a script, argv: rank rendezvous_file out_dir. It makes the group itself, by hand
(``init_process_group`` over a file store, no torch variables in the environment), records
what launch refuses, then runs the loop under ddp.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

import scopedlite as lite
from _common import make_data, make_model

N, BATCH = 9, 2


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.data = make_data(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return i, x, y


def full_params(model: torch.nn.Module, strategy: str) -> list[list[float]]:
    inner = lite.current().strategy.unwrap(model)
    if strategy == "deepspeed":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(inner.parameters())):
            return [p.detach().float().flatten().tolist() for p in inner.parameters()]
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist() for p in inner.parameters()
    ]


def loop(strategy: str, out_dir: str) -> None:
    with lite.launch(strategy=strategy) as run:  # devices="auto": the group's ranks on this node
        model = make_model()
        model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = lite.setup_dataloader(torch.utils.data.DataLoader(Indexed(N), batch_size=BATCH))
        seen: list[int] = []
        with lite.join(model):
            for idx, x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                lite.backward(loss)
                opt.step()
                opt.zero_grad()
                seen += idx.tolist()
        path = os.path.join(out_dir, f"{strategy}.ckpt")
        lite.save(path, {"model": model, "opt": opt, "loader": loader})
        fresh = make_model(seed=5)
        fresh, fresh_opt = lite.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
        lite.load(path, {"model": fresh, "opt": fresh_opt})
        record = {
            "place": [run.global_rank, run.local_rank, run.world_size, run.local_world_size],
            "seen": seen,
            "params": full_params(model, strategy),
            "loaded": full_params(fresh, strategy),
            "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")},
        }
    # The group is its maker's: still there, and usable, after the block.
    record["group_after"] = [dist.is_initialized(), dist.get_world_size(), dist.get_backend()]
    total = torch.ones(1)
    dist.all_reduce(total)
    record["group_after"].append(total.item())
    with open(os.path.join(out_dir, f"{strategy}.rank{record['place'][0]}.json"), "w") as f:
        json.dump(record, f)


def refusals() -> dict[str, str]:
    said = {}
    for name, kwargs in {"devices": {"devices": 3}, "num_nodes": {"num_nodes": 2}, "timeout": {"timeout": 30}}.items():
        try:
            with lite.launch(strategy="ddp", **kwargs):
                said[name] = "not refused"
        except ValueError as e:
            said[name] = str(e)
    return said


if __name__ == "__main__":
    rank, rendezvous, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    with open(os.path.join(out_dir, f"refusals.rank{rank}.json"), "w") as f:
        json.dump(refusals(), f)
    loop("ddp", out_dir)
    # The loop's DDP models are garbage (reference cycles: DDP's own, plain torch has them too)
    # but not yet collected. A DDP still alive when its group is destroyed aborts the process
    # at exit now and then ("terminate called without an active exception", torch 2.13, gloo,
    # about 1 run in 6 with plain DDP and no scopedlite), so collect them first, as a script
    # that destroys its own group must.
    gc.collect()
    dist.destroy_process_group()
