"""What the hang watchdog costs a training step, and what one of its looks costs.

argv: OUT WARMUP STEPS BLOCKS. Blocks of launch blocks (2 CPU processes, ddp), each running
WARMUP + STEPS steps of the shared workload, the watchdog's setting rotating from launch block
to launch block (it is read when a block starts): ``off`` (SCOPEDLITE_HANG_TIMEOUT=off,
SCOPEDLITE_TERM_GRACE=off: no thread), ``default`` (a look every 2 s) and ``eager``
(SCOPEDLITE_HANG_TIMEOUT=0.2: a look every 50 ms, 40 times the default). In the last block
rank 0 also times 200 calls of one look (the main thread's stack, the episode, the store
writes and rank 0's reads of every rank's entry) directly. Rank 0 writes everything to OUT.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import scopedlite as lite
from scopedlite._comm.distributed import run_store
from scopedlite._launch.watchdog import HangWatchdog, Limits
from workload import BATCH, make_dataset, make_model, make_optimizer, train_timed, write_result

out, warmup, steps, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
SETTINGS = {"off": ("off", "off"), "default": ("", ""), "eager": ("0.2", "")}
record: dict[str, list[list[float]]] = {name: [] for name in SETTINGS}
cpu: dict[str, list[list[float]]] = {name: [] for name in SETTINGS}
look_s: list[float] = []
for block in range(blocks):
    names = list(SETTINGS)
    for name in names[block % 3 :] + names[: block % 3]:
        hang, grace = SETTINGS[name]
        os.environ["SCOPEDLITE_HANG_TIMEOUT"], os.environ["SCOPEDLITE_TERM_GRACE"] = hang, grace
        with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
            dataset = make_dataset((warmup + steps) * BATCH * run.world_size)
            model = make_model()
            model, opt = lite.setup(model, make_optimizer(model))
            loader = lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=BATCH))
            lite.barrier()
            times, cpu_times = train_timed(model, opt, loader, lite.backward, warmup)
            if run.is_global_zero:
                record[name].append(times)
                cpu[name].append(cpu_times)
            if block == blocks - 1 and name == names[-1]:
                probe = HangWatchdog(
                    run.global_rank, run.world_size, run_store(None), "bench/probe", Limits(1e9, None), lambda: False
                )
                for _ in range(200):
                    start = time.perf_counter()
                    probe._tick()
                    look_s.append(time.perf_counter() - start)
                lite.barrier()
write_result(out, {"steps": record, "cpu": cpu, "look_s": look_s})
