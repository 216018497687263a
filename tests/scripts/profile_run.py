"""lite.profile on real ranks: a schedule of two cycles, chosen ranks, and uneven data in join.

argv: strategy devices
Writes, per rank, what ``prof.traces`` and ``prof.enabled`` said in each block; the test opens
the trace files themselves (the folders are relative to the working directory, the test's).
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_data, make_model, write

strategy, devices = sys.argv[1], int(sys.argv[2])


def train_step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    lite.backward(loss)
    opt.step()
    opt.zero_grad()


with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=60):
    rank = lite.current().global_rank
    model = make_model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = make_data(32)
    record = {"rank": rank}

    # Two cycles of wait 1, warmup 1, active 2 over 9 steps: traces end at steps 4 and 8.
    with lite.profile("every", wait=1, warmup=1, active=2, repeat=2) as prof:
        for i in range(9):
            train_step(model, opt, data.tensors[0][i : i + 2], data.tensors[1][i : i + 2])
            prof.step()
    record["every"] = {"enabled": prof.enabled, "traces": [p.name for p in prof.traces]}

    # Only rank 1 records; the others' step() does nothing.
    with lite.profile("chosen", ranks=[1], wait=0, warmup=0, active=1, profile_memory=True) as prof:
        for i in range(2):
            train_step(model, opt, data.tensors[0][i : i + 2], data.tensors[1][i : i + 2])
            prof.step()
    record["chosen"] = {"enabled": prof.enabled, "traces": [p.name for p in prof.traces]}

    # Uneven data inside join: rank 0 has 5 batches, rank 1 has 3, so rank 1 leaves the block
    # during its active cycle (steps 2..4) and still writes what it recorded.
    loader = [(data.tensors[0][i : i + 2], data.tensors[1][i : i + 2]) for i in range(5 if rank == 0 else 3)]
    with lite.join(model), lite.profile("joined", wait=1, warmup=1, active=3) as prof:
        for x, y in loader:
            train_step(model, opt, x, y)
            prof.step()
    record["joined"] = {"enabled": prof.enabled, "traces": [p.name for p in prof.traces]}
    everyone = from_every_rank(record)
    if rank == 0:
        write(everyone)
