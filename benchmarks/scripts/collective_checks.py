"""Per-call cost of the shape check in front of ``lite.all_reduce`` / ``all_gather``.

argv: OUT CALLS. One 2-process gloo launch. CALLS rounds, each timing one call of every mode
back to back, the order rotating from round to round, so a burst of load on the shared
machine hits all modes alike:

- ``raw_all_reduce``: ``torch.distributed.all_reduce`` of a 4-float tensor, in place;
- ``unchecked_all_reduce``: the strategy's own all-reduce, what ``lite.all_reduce`` runs after
  its check (a copy, the reduction);
- ``lite_all_reduce``: ``lite.all_reduce`` (the check's one small all-gather, then the above);
- ``raw_all_gather`` / ``lite_all_gather``: the same for a 4-float all-gather;
- ``lite_gather_for_metrics``: ``lite.gather_for_metrics`` of a (16, 4) batch.

Rank 0 writes the seconds of every call to OUT.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import scopedlite as lite
from workload import write_result

out, calls = sys.argv[1], int(sys.argv[2])

with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
    small = torch.arange(4.0) + run.global_rank
    batch = torch.randn(16, 4)
    parts = [torch.empty_like(small) for _ in range(run.world_size)]
    modes = {
        "raw_all_reduce": lambda: dist.all_reduce(small),
        "unchecked_all_reduce": lambda: run.strategy.all_reduce(small, "sum"),
        "lite_all_reduce": lambda: lite.all_reduce(small),
        "raw_all_gather": lambda: dist.all_gather(parts, small),
        "lite_all_gather": lambda: lite.all_gather(small),
        "lite_gather_for_metrics": lambda: lite.gather_for_metrics(batch),
    }
    names = list(modes)
    record: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        for _ in range(20):
            modes[name]()
    lite.barrier()
    for i in range(calls):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn = modes[name]
            start = time.perf_counter()
            fn()
            record[name].append(time.perf_counter() - start)
    if run.is_global_zero:
        write_result(out, record)
