"""Per-step cost of ``lite.join`` when it has nothing to do (every rank has the same data).

argv: OUT WARMUP STEPS BLOCKS [STRATEGY]. One launch, one model; each block runs one epoch of
WARMUP + STEPS steps without join, one inside ``with lite.join(model):`` and, under ``ddp``
(the default), one inside torch's own ``Join([model])`` (to tell torch's per-step cost of join
mode apart from ours), then the same batches as a plain list (a loop whose length the join
session does not know: a round every step) without join and inside ``lite.join``, the order
rotating from block to block so slow drift of the machine hits all alike. Under ``fsdp`` or
``deepspeed_stage_3`` torch's ``Join`` has nothing to offer (it hangs on uneven data there), so
only the first two modes run.
Rank 0 writes the step times of every block to OUT.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.algorithms.join import Join

import scopedlite as lite
from workload import BATCH, make_dataset, make_model, make_optimizer, train_timed, write_result

out, warmup, steps, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
strategy = sys.argv[5] if len(sys.argv) > 5 else "ddp"

with lite.launch(strategy=strategy, devices=2, accelerator="cpu") as run:
    dataset = make_dataset((warmup + steps) * BATCH * run.world_size)
    model = make_model()
    model, opt = lite.setup(model, make_optimizer(model))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True))
    listed = list(loader)  # this rank's batches of one pass, as a plain list
    modes = ("plain", "join", "list", "join_list") + (("torch_join",) if strategy == "ddp" else ())
    record: dict[str, list[list[float]]] = {mode: [] for mode in ("plain", "join", "torch_join", "list", "join_list")}
    for block in range(blocks):
        for mode in modes[block % len(modes) :] + modes[: block % len(modes)]:
            lite.barrier()
            batches = listed if mode.endswith("list") else loader
            if mode.startswith("join"):
                with lite.join(model):
                    times, _ = train_timed(model, opt, batches, lite.backward, warmup)
            elif mode == "torch_join":
                with Join([model]):
                    times, _ = train_timed(model, opt, batches, lite.backward, warmup)
            else:
                times, _ = train_timed(model, opt, batches, lite.backward, warmup)
            record[mode].append(times)
    if run.is_global_zero:
        write_result(out, record)
