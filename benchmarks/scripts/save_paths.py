"""What checking that every rank passes the same path costs ``lite.save`` (and ``lite.load``).

argv: OUT FOLDER CALLS BLOCKS [STRATEGY]. One 2-process launch; each block times CALLS calls
of each mode, the order rotating from block to block: the check alone
(``check_same_path``: one all-reduce of two int64s), ``lite.barrier()`` (the smallest
collective, for scale), ``lite.save`` of a small model and optimizer (one ``Linear(64, 64)``
and SGD: a save where the check weighs most), and the same save with the check replaced by a
no-op. Rank 0 writes the per-call times of every block to OUT.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import scopedlite as lite
from scopedlite._api import checkpoint
from scopedlite._api.checkpoint_path import check_same_path
from workload import write_result

out, folder, calls, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
strategy = sys.argv[5] if len(sys.argv) > 5 else "ddp"


def no_check(path: object, caller: str) -> None:
    """The save without the check (what ``lite.save`` did before it)."""


def timed(fn) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


with lite.launch(strategy=strategy, devices=2, accelerator="cpu") as run:
    model = torch.nn.Linear(64, 64)
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    path = os.path.join(folder, "ckpt.pt")
    state = {"model": model, "opt": opt, "step": 0}

    def save_without_check() -> None:
        checkpoint.check_same_path = no_check
        try:
            lite.save(path, state)
        finally:
            checkpoint.check_same_path = check_same_path

    modes = {
        "check": lambda: check_same_path(path, "lite.save"),
        "barrier": lite.barrier,
        "save": lambda: lite.save(path, state),
        "save_without_check": save_without_check,
    }
    names = list(modes)
    record: dict[str, list[list[float]]] = {name: [] for name in names}
    for block in range(blocks):
        for name in names[block % len(names) :] + names[: block % len(names)]:
            lite.barrier()
            record[name].append(timed(modes[name]))
    if run.is_global_zero:
        write_result(out, record)
