"""Every collective, on tensors, numbers and nested structures; rank 0 writes all results.

argv: devices
"""

import os
import sys

import torch

import scopedlite as lite
from _common import write

devices = int(sys.argv[1])


def plain(obj):
    if isinstance(obj, torch.Tensor):
        return obj.item()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


with lite.launch(strategy="ddp", devices=devices, accelerator="cpu", timeout=60) as run:
    r = run.global_rank
    value = torch.tensor([r + 1.0, -(r + 1.0)])
    out = {
        "sum": lite.all_reduce(value, op="sum").tolist(),
        "mean": lite.all_reduce(value, op="mean").tolist(),
        "max": lite.all_reduce(value, op="max").tolist(),
        "min": lite.all_reduce(value, op="min").tolist(),
        "int_sum": lite.all_reduce(r + 1),
        "int_mean": lite.all_reduce(r + 1, op="mean"),
        "float_max": lite.all_reduce(float(r) / 2, op="max"),
        "bool_max": lite.all_reduce(r == 1, op="max"),
        "nested": plain(lite.all_reduce({"a": [r, torch.tensor(float(r))], "b": (1, 2.5)}, op="sum")),
        "input_unchanged": value.tolist(),
        "gather": lite.all_gather(torch.tensor([r, 10 * r])).tolist(),
        "gather_number": lite.all_gather(r).tolist(),
        "broadcast_tensor": lite.broadcast(torch.arange(3) * 7 if r == 1 else None, src=1).tolist(),
        "broadcast_obj": lite.broadcast({"from": r, "list": [r] * 2}, src=devices - 1),
        "world": [run.world_size, run.local_world_size, run.node_rank],
    }
    lite.barrier()
    marker = os.environ["OUT"] + ".rank0-was-here"
    with lite.rank_zero_first():
        out["rank0_done_before"] = os.path.exists(marker)  # rank 0 leaves its block first
        if run.global_rank == 0:
            open(marker, "w").close()
    everyone = [lite.broadcast(out, src=i) for i in range(run.world_size)]
    lite.print("printed once")
    if run.is_global_zero:
        write(everyone)
