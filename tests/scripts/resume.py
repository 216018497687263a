"""Preempted and resumed training (tests/test_resume.py): dropout, shuffle=True, a loader in the checkpoint.

argv: strategy devices job [job ...], each job ``name,kind,join|nojoin,num_workers,stop_step``:

- ``ref``: an uninterrupted run;
- ``run``: a run that first loads the job's checkpoint if there is one (a restart), and, when
  ``stop_step`` > 0, has rank 0 send itself a real SIGTERM after that run-wide step; the loop
  notices ``lite.should_stop()``, saves model, optimizer, loader, epoch and step, and leaves;
- ``every``: a run that saves its checkpoint after every step, with a 16 MB tensor in it so
  that the test can SIGKILL it while it writes;
- ``epoch``: a run that saves at the epoch boundary after ``stop_step`` epochs and leaves;
- ``tryload``: a ``run`` whose ``lite.load`` may refuse the checkpoint: the ValueError is
  that job's result on every rank, and the launch goes on with the next job.

A sixth field ``nodrop`` builds the model without dropout (the test replays it in plain torch).

Each run trains 3 epochs of 33 samples in batches of 4: on 2 ranks 17 and 16 samples inside
``lite.join`` (5 and 4 batches), 17 each outside. A job's checkpoint is
``<folder of $OUT>/<name>.ckpt``. Once a SIGTERM came, ``should_stop()`` stays True, so a
stopping job comes last. Rank 0 writes, per job, every rank's final parameters (None when
stopped) and the sample indices it read per epoch.
"""

import os
import signal
import sys

import torch

import scopedlite as lite
from _common import write

strategy, devices, jobs = sys.argv[1], int(sys.argv[2]), [j.split(",") for j in sys.argv[3:]]
EPOCHS, N = 3, 33
folder = os.path.dirname(os.environ["OUT"])


def build(workers, dropout=True):
    lite.seed_everything(7)
    middle = torch.nn.Dropout(0.5) if dropout else torch.nn.Identity()
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), middle, torch.nn.Linear(16, 1))
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g), torch.arange(N)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=workers)
    return model, opt, lite.setup_dataloader(loader)


def one_pass(model, opt, loader, state, read, stop_at, ckpt, every):
    """One pass over the loader; True when it stopped for a SIGTERM."""
    for x, y, index in loader:
        read.setdefault(state["epoch"], []).extend(index.tolist())
        loss = torch.nn.functional.mse_loss(model(x), y)
        lite.backward(loss)
        opt.step()
        opt.zero_grad()
        state["step"] += 1
        if state["step"] == stop_at and lite.current().is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)  # what SLURM or Kubernetes sends
        if every:
            lite.save(ckpt, {**state, "blob": torch.zeros(4 * 2**20)})
        if lite.should_stop():
            return True
    return False


def train(name, kind, join, workers, stop_at, dropout=True):
    ckpt = os.path.join(folder, f"{name}.ckpt")
    model, opt, loader = build(workers, dropout)
    state = {"model": model, "opt": opt, "loader": loader, "epoch": 0, "step": 0}
    if kind in ("run", "tryload") and os.path.exists(ckpt):
        try:
            lite.load(ckpt, state)  # what it holds besides `state` (an `every` run's blob) is returned
        except ValueError as e:
            if kind != "tryload":
                raise
            return f"ValueError: {e}", {}
    read = {}
    signal_at = 0 if kind == "epoch" else stop_at  # an `epoch` job counts epochs, not steps
    while state["epoch"] < EPOCHS:
        if join == "join":
            with lite.join(model):
                one_pass(model, opt, loader, state, read, signal_at, ckpt, kind == "every")
        else:
            one_pass(model, opt, loader, state, read, signal_at, ckpt, kind == "every")
        # a rank that ran out of data inside lite.join did not take part in the last
        # should_stop(): asked again here, every rank agrees
        if lite.should_stop():
            lite.save(ckpt, state)  # outside lite.join, so every rank takes part
            return None, read
        state["epoch"] += 1
        if kind == "epoch" and state["epoch"] == stop_at:
            lite.save(ckpt, state)  # between passes
            return None, read
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # FSDP: gathered
    return [p.detach().flatten().tolist() for p in full], read


with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=60) as run:
    results = []
    for name, kind, join, workers, stop_at, *model in jobs:
        params, read = train(name, kind, join, int(workers), int(stop_at), model != ["nodrop"])
        ranks = [lite.broadcast((params, read), src=r) for r in range(run.world_size)]
        results.append([{"params": p, "read": {str(e): i for e, i in r.items()}} for p, r in ranks])
    if run.is_global_zero:
        write(results)
