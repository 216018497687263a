"""What the steps comparison costs an FSDP training step.

argv: OUT WARMUP STEPS BLOCKS. One 2-process fsdp launch; per block, one pass over the shared
workload in each mode, alternating: ``compared`` (the default: each ``lite.backward`` posts the
digest of the optimizers' steps since the previous one in an all-reduce of two int64 and reads
it after the backward, ``stepped.py``) and ``off`` (the run's digest replaced by None, as one
rank has it: the backward runs alone). The optimizers' step pre-hook notes every step in both.
Rank 0 writes the per-step wall and CPU times of each mode to OUT.
"""

from __future__ import annotations

import sys

import torch

import scopedlite as lite
from workload import BATCH, make_dataset, make_model, make_optimizer, train_timed, write_result

out, warmup, steps, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
MODES = ("compared", "off")
record: dict[str, list[list[float]]] = {name: [] for name in MODES}
cpu: dict[str, list[list[float]]] = {name: [] for name in MODES}
with lite.launch(strategy="fsdp", devices=2, accelerator="cpu") as run:
    dataset = make_dataset((warmup + steps) * BATCH * run.world_size)
    model = make_model()
    model, opt = lite.setup(model, make_optimizer(model))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=BATCH))
    stepped = run.strategy._stepped  # the benchmark's switch: no public one turns the check off
    assert stepped is not None, "the fsdp strategy compares no steps: nothing to measure"
    for block in range(blocks):
        for name in MODES if block % 2 == 0 else MODES[::-1]:
            run.strategy._stepped = stepped if name == "compared" else None
            lite.barrier()
            times, cpu_times = train_timed(model, opt, loader, lite.backward, warmup)
            record[name].append(times)
            cpu[name].append(cpu_times)
    run.strategy._stepped = stepped
    if run.is_global_zero:
        write_result(out, {"steps": record, "cpu": cpu})
