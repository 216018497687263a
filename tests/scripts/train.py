"""Train with setup/setup_dataloader/backward; rank 0 writes final parameters.

argv: strategy devices n batch_size [join]
"""

import json
import os
import sys
from pathlib import Path

import torch

import scopedlite as lite
from _common import make_data, make_model, params, write

strategy, devices, n, batch_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
use_join = len(sys.argv) > 5 and sys.argv[5] == "join"

threads_before = torch.get_num_threads()
with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=60) as run:
    # SPEC 4: each of N local processes on C cores gets max(1, C // N) torch threads
    threads = [lite.broadcast(torch.get_num_threads(), src=r) for r in range(run.world_size)]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = lite.setup(model, opt)
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(n), batch_size=batch_size))
    seen, steps, means, locals_ = [], 0, [], []
    scope = lite.join(model) if use_join else __import__("contextlib").nullcontext()
    with scope:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
            means.append(lite.all_reduce(loss.detach(), op="mean").item())
            locals_.append(loss.item())
            steps += 1
    gathered = lite.all_gather(torch.tensor(params(model)[0]))
    per_rank = lite.broadcast({"steps": steps, "means": means, "locals": locals_}, src=0)
    everyone = [
        lite.broadcast({"steps": steps, "means": means, "locals": locals_}, src=r) for r in range(run.world_size)
    ]
    if run.is_global_zero:
        write(
            {
                "params": params(lite.current().strategy.unwrap(model)),
                "first_param_on_each_rank": gathered.tolist(),
                "ranks": everyone,
                "world_size": run.world_size,
                "threads": threads,
            }
        )
if run.is_global_zero:  # this process wrote (under mpirun or srun every rank's process gets here)
    record = json.loads(Path(os.environ["OUT"]).read_text())
    record["threads_before"], record["threads_after"] = threads_before, torch.get_num_threads()
    record["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    record["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    write(record)
