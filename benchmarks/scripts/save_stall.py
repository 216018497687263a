"""How long ``lite.save`` stalls the training loop: blocking vs ``blocking=False``.

argv: OUT FOLDER STRATEGY ROUNDS. One 2-process launch of a 201 MB model (12 x
``Linear(2048, 2048)``, float32; saved: the model and the step) trained on batches of 2,
only its last layer (the others frozen: a step costs little next to a save, and the
checkpoint is still the whole model). Under fsdp a step would all-gather the whole model
(seconds here on gloo), so there the loop between saves does not train: it checks every 50
ms whether the write is done (the stall in ``lite.save`` is measured the same way).
First one blocking and one background save, untimed but for the first background call (the
buffers are allocated then); then ROUNDS rounds, each a blocking save and a background save,
the order alternating. A stall is what the training thread spends in ``lite.save`` (rank 0,
``perf_counter``); for a background save the loop then trains on until every rank's part is
written (one all-reduce of a flag per step says when), and the wait that follows (the ranks
agreeing it is complete) is part of the stall. Two plain steps follow every save: the step
time without a write, beside the step time while one is written. Rank 0 writes the times.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import scopedlite as lite
from workload import write_result

out, folder, strategy, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
LAYERS, WIDTH = 12, 2048


def all_done(handle: lite.SaveHandle | None) -> bool:
    flag = torch.tensor([1 if handle is None or handle.done() else 0])
    return bool(lite.all_reduce(flag, op="min").item())


with lite.launch(strategy=strategy, devices=2, accelerator="cpu") as run:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    model[:-1].requires_grad_(False)
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=1e-6))
    path = os.path.join(folder, "ckpt")
    # SGD keeps no state: the checkpoint is the model (and torch's get_optimizer_state_dict
    # would run a zero step at every save to make a state, its slow path for a stateless
    # optimizer under fsdp, ~0.1 s here)
    state = {"model": model, "step": 0}
    record: dict[str, list[float]] = {
        "blocking": [],
        "background": [],
        "wait": [],
        "plain_steps": [],
        "writing_steps": [],
    }

    def step(times: list[float] | None, handle: lite.SaveHandle | None = None) -> bool:
        start = time.perf_counter()
        if strategy == "fsdp":
            time.sleep(0.05)
        else:
            lite.backward(model(torch.randn(2, WIDTH)).square().mean())
            opt.step()
            opt.zero_grad()
        done = all_done(handle)
        if times is not None:
            times.append(time.perf_counter() - start)
        state["step"] += 1
        return done

    def blocking() -> None:
        start = time.perf_counter()
        lite.save(path, state)
        record["blocking"].append(time.perf_counter() - start)

    def background(times: dict[str, list[float]] | None = None) -> float:
        start = time.perf_counter()
        handle = lite.save(path, state, blocking=False)
        returned = time.perf_counter() - start
        while not step(record["writing_steps"] if times is not None else None, handle):
            pass
        start = time.perf_counter()
        handle.wait()
        waited = time.perf_counter() - start
        if times is not None:
            times["background"].append(returned + waited)
            times["wait"].append(waited)
        return returned + waited

    def floor() -> None:
        """The copy alone: this rank's tensors into buffers allocated before (the floor of a
        background save's stall, which is this copy and some bookkeeping)."""
        local = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
        buffers = [torch.empty_like(t) for t in local]
        for b, t in zip(buffers, local):
            b.copy_(t)
        start = time.perf_counter()
        for b, t in zip(buffers, local):
            b.copy_(t)
        record.setdefault("copy_floor", []).append(time.perf_counter() - start)

    for _ in range(2):
        step(None)
    blocking()
    first = background()
    record["blocking"].clear()
    for r in range(rounds):
        for mode in ("blocking", "background") if r % 2 == 0 else ("background", "blocking"):
            blocking() if mode == "blocking" else background(record)
            for _ in range(2):
                step(record["plain_steps"])
        floor()
    if run.is_global_zero:
        write_result(out, {**record, "first_background": first})
