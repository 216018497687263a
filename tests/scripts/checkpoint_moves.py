"""Checkpoints move between strategies and world sizes (tests/test_checkpoint_moves.py).

argv: folder, then launches as JSON: ``[[strategy, devices, [job, ...]], ...]``, run one after
another in this process (several only on one process); ``hsdp`` stands for
``FSDPStrategy(replicate_degree=2)``. Jobs, each with fresh objects:

- ``save:NAME``: train epoch 0 from seed 0, save model, optimizer, loader, step and a note to
  ``folder/NAME``;
- ``load:NAME``: build from seed 1 (other values), load ``folder/NAME``, train epoch 1;
- ``midsave:NAME``: as ``save``, but saved after the first step of epoch 0 (model, optimizer,
  loader in the middle of its pass, step);
- ``midload:NAME``: build from seed 1, load ``folder/NAME``, the rest of epoch 0, epoch 1;
- ``bigsave:NAME``: a model of eight 4 MB parameters, one AdamW step, saved;
- ``bigload:NAME``: the same model set up fresh; its peak memory while ``lite.load`` reads;
- ``plain:NAME``: build from seed 1, load ``folder/NAME``, a file plain torch wrote (a bare
  ``model.state_dict()``, or a dict of a model's and an optimizer's state dicts and an
  epoch), train one pass;
- ``paths:NAME``: ``lite.save`` and ``lite.load`` with a path that differs by rank (each rank's
  error and what was written), then the fix the error names;
- ``async:NAME``: as ``save``, with ``blocking=False``, then epoch 1 trained, the learning rate
  and the note changed before anything waits (a later ``load:NAME`` checks what was written);
  then two saves to the same path whose background write fails (an entry torch cannot
  pickle): one waited for, one found by the next save. Under deepspeed: the refusal;
- ``inflight:NAME``: as ``save``, with ``blocking=False``, and nothing waits: the end of the
  launch block must (the last job of its launch).

Rank 0 writes, per launch and job: the global mean loss of each step, the step count and note
loaded, what load returned, the final parameters; for ``bigload`` every rank's memory.
"""

import ctypes
import gc
import json
import os
import sys
from pathlib import Path

import torch

import scopedlite as lite
from _common import write
from _moves_common import BATCH, Big, make_data, make_net, make_optimizer, sampler

folder, launches = sys.argv[1], json.loads(sys.argv[2])

# glibc keeps freed blocks in its heap, where RSS would go on counting them: every block above
# 64 KiB mapped on its own (M_MMAP_THRESHOLD, which MALLOC_MMAP_THRESHOLD_ sets at start) makes
# RSS the memory in use (bigload).
ctypes.CDLL(None).mallopt(-3, 65536)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_epoch(model, opt, loader):
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        lite.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(lite.all_reduce(loss.detach(), op="mean").item())
    return losses


def setup(seed):
    run = lite.current()
    model = make_net(seed)
    model, opt = lite.setup(model, make_optimizer(model))
    data = make_data()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler(data, run.world_size, run.global_rank))
    return model, opt, lite.setup_dataloader(loader)


def save(name, strategy):
    model, opt, loader = setup(seed=0)
    losses = train_epoch(model, opt, loader)
    note = {"from": strategy, "tensor": torch.arange(3.0)}
    lite.save(
        os.path.join(folder, name), {"model": model, "opt": opt, "loader": loader, "step": len(losses), "note": note}
    )
    return {"losses": losses}


def mid_save(name, strategy):
    """Epoch 0 from seed 0, saved after its first step: the loader in the middle of its pass."""
    model, opt, loader = setup(seed=0)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        lite.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(lite.all_reduce(loss.detach(), op="mean").item())
        if len(losses) == 1:
            lite.save(os.path.join(folder, name), {"model": model, "opt": opt, "loader": loader, "step": 1})
    return {"losses": losses}


def mid_load(name):
    """Seed 1, the mid-epoch checkpoint loaded: the rest of epoch 0, then epoch 1."""
    model, opt, loader = setup(seed=1)
    state = {"model": model, "opt": opt, "loader": loader, "step": 0}
    lite.load(os.path.join(folder, name), state)
    return {
        "rest_of_epoch": train_epoch(model, opt, loader),
        "next_epoch": train_epoch(model, opt, loader),
        "step": state["step"],
    }


def load(name):
    model, opt, loader = setup(seed=1)
    state = {"model": model, "opt": opt, "loader": loader, "step": 0, "note": None}
    rest = lite.load(os.path.join(folder, name), state)
    losses = train_epoch(model, opt, loader)
    params = {k: full(v).detach().flatten().tolist() for k, v in model.state_dict().items()}
    note = {"from": state["note"]["from"], "tensor": state["note"]["tensor"].tolist()}
    return {
        "losses": losses,
        "step": state["step"],
        "note": note,
        "rest": sorted(rest),
        "params": params,
        "deepspeed_imported": "deepspeed" in sys.modules,
    }


def big_setup():
    torch.manual_seed(0)
    model = Big()
    return lite.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def big_save(name):
    model, opt = big_setup()
    lite.backward(model(torch.randn(2, 1024)).square().mean())
    opt.step()
    opt.zero_grad()
    lite.save(os.path.join(folder, name), {"model": model, "opt": opt})
    return {}


def memory():
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def big_load(name):
    """Peak memory while loading, above what the process held before, less the optimizer
    state the load creates (which the run keeps): what reading the checkpoint needed."""
    model, opt = big_setup()
    gc.collect()
    lite.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    before, _ = memory()
    lite.load(os.path.join(folder, name), {"model": model, "opt": opt})
    after, peak = memory()
    kept = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for values in opt.state.values()
        for t in values.values()
        if isinstance(t, torch.Tensor)
    )
    numbers = torch.tensor([peak - before - kept, after - before, kept], dtype=torch.float64)
    return {"ranks": lite.all_gather(numbers).tolist()}


def plain(name):
    """A plain torch file into the set-up model (and optimizer, when the file has one)."""
    model, opt, loader = setup(seed=1)
    path = os.path.join(folder, name)
    nested = "optimizer" in torch.load(path, weights_only=True)
    rest = lite.load(path, {"model": model, "optimizer": opt} if nested else {"model": model})
    loaded = {k: full(v).detach().flatten().tolist() for k, v in model.state_dict().items()}
    losses = train_epoch(model, opt, loader)
    return {"loaded": loaded, "rest": rest, "losses": losses}


def paths(name):
    """Each rank's own folder, as ``tempfile.mkdtemp()`` at the top of a script gives."""
    run = lite.current()
    model, opt, _ = setup(seed=0)
    state = {"model": model, "opt": opt}
    mine = os.path.join(folder, f"{name}-rank{run.global_rank}", "ckpt")
    errors = {}
    for what, call in (("save", lite.save), ("load", lite.load)):
        try:
            call(mine, state)
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    written = sorted(n for n in os.listdir(folder) if n.startswith(f"{name}-"))
    lite.barrier()
    shared = lite.broadcast(mine)  # the fix the error names
    lite.save(shared, state)
    # the same path written another way on rank 1 (relative: the script runs in the folder)
    rest = lite.load(shared if run.global_rank == 0 else os.path.relpath(shared), state)
    return {
        "errors": [lite.broadcast(errors, src=rank) for rank in range(run.world_size)],
        "written": written,
        "fixed": sorted(n for n in os.listdir(folder) if n.startswith(f"{name}-")),
        "rest": rest,
    }


def save_in_background(name, strategy):
    model, opt, loader = setup(seed=0)
    losses = train_epoch(model, opt, loader)
    note = {"from": strategy, "tensor": torch.arange(3.0)}
    path = os.path.join(folder, name)
    state = {"model": model, "opt": opt, "loader": loader, "step": len(losses), "note": note}
    try:
        handle = lite.save(path, state, blocking=False)
    except ValueError as e:
        return {"losses": losses, "refused": str(e)}
    # none of this may reach the checkpoint: it was copied when save returned
    train_epoch(model, opt, loader)
    opt.param_groups[0]["lr"] = 0.5
    note["tensor"] += 100
    returned = {"losses": losses, "handle": repr(handle)}  # the load job waits for it
    entries = {"step": 0}
    lite.load(path, entries, strict=False)  # waits, then reads the complete checkpoint
    returned["waited"] = [repr(handle), handle.done(), entries["step"]]

    def unpicklable():  # torch.save fails on it in the background (rank 0 writes the entries)
        pass

    failing = {"model": model, "opt": opt, "hook": unpicklable}
    errors = {}
    handle = lite.save(path, failing, blocking=False)
    try:
        handle.wait()
    except lite.CheckpointError as e:
        errors["wait"] = [str(e), type(e.__cause__).__name__]
    lite.save(path, failing, blocking=False)
    try:  # the next save raises it instead, and does not write
        lite.save(os.path.join(folder, f"{name}-next"), {"model": model})
    except lite.CheckpointError as e:
        errors["next_save"] = [str(e), type(e.__cause__).__name__]
    returned["errors"] = [lite.broadcast(errors, src=rank) for rank in range(lite.current().world_size)]
    returned["left"] = sorted(n for n in os.listdir(folder) if n.startswith(f".{name}") or n.startswith(f"{name}-"))
    return returned


def left_in_flight(name, strategy):
    model, opt, loader = setup(seed=0)
    losses = train_epoch(model, opt, loader)
    lite.save(os.path.join(folder, name), {"model": model, "opt": opt, "step": len(losses)}, blocking=False)
    return {"losses": losses}


JOBS = {
    "async": save_in_background,
    "inflight": left_in_flight,
    "save": save,
    "midsave": mid_save,
    "midload": mid_load,
    "load": load,
    "bigsave": big_save,
    "bigload": big_load,
    "plain": plain,
    "paths": paths,
}

# names of this script for strategies no launch(strategy=) name stands for
INSTANCES = {"hsdp": lambda: lite.FSDPStrategy(replicate_degree=2)}

results = []
for strategy, devices, jobs in launches:
    chosen = INSTANCES[strategy]() if strategy in INSTANCES else strategy
    with lite.launch(strategy=chosen, devices=devices, accelerator="cpu", timeout=60) as run:
        done = {}
        for job in jobs:
            kind, name = job.split(":")
            done[job] = (
                JOBS[kind](name, strategy) if kind in ("save", "async", "inflight", "midsave") else JOBS[kind](name)
            )
        results.append({"strategy": strategy, "world_size": run.world_size, "jobs": done})
write(results)  # only the main process (rank 0) gets here: the others leave at the end of the block
