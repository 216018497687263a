"""Memory per rank of a model built in ``lite.sharded_init()`` and set up, 2 CPU ranks.

argv: STRATEGY OUT. The model is 8 x ``Linear(1024, 1024)`` (8.4 M float32 parameters, 33.6 MB).
Each rank records its resident set size (RSS) before ``sharded_init``, after building the
model in it, and after ``lite.setup(model)``, plus the bytes of parameter storage it holds:
the local shard (FSDP ``DTensor.to_local()``, DeepSpeed ``ds_tensor``) or the whole parameter
(DDP). Rank 0 gathers every rank's numbers and writes them to OUT as JSON.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import torch

import scopedlite as lite
from workload import write_result

strategy, out = sys.argv[1], sys.argv[2]
# "control": one tiny layer, to tell the model's memory from what the machinery costs itself
LAYERS, WIDTH = (1, 8) if len(sys.argv) > 3 and sys.argv[3] == "control" else (8, 1024)


def rss() -> int:
    """RSS after a GC and after handing freed heap back to the OS (glibc ``malloc_trim``), so a
    temporary freed before the measurement does not count."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:  # Linux: no dependency needed
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def param_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            total += p.ds_tensor.numel() * p.ds_tensor.element_size()
        elif hasattr(p, "to_local"):
            local = p.to_local()
            total += local.numel() * local.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=120) as run:
    before = rss()
    with lite.sharded_init():
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    built = rss()
    model = lite.setup(model)
    ready = rss()
    mine = {
        "param_bytes": param_bytes(model),
        "rss_before": before,
        "rss_built": built,
        "rss_ready": ready,
    }
    keys = ("param_bytes", "rss_before", "rss_built", "rss_ready")
    rows = lite.all_gather(torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64))
    ranks = [{"rank": r, **{k: int(v) for k, v in zip(keys, row.tolist())}} for r, row in enumerate(rows)]
    if run.global_rank == 0:
        full = (
            sum(
                p.numel()
                for p in torch.nn.Sequential(
                    *[torch.nn.Linear(WIDTH, WIDTH, device="meta") for _ in range(LAYERS)]
                ).parameters()
            )
            * 4
        )
        write_result(out, {"strategy": strategy, "full_bytes": full, "ranks": ranks})
