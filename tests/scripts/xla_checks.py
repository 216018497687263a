"""XLA checks run by tests/test_xla.py under the XLA venv's interpreter, with PJRT_DEVICE=CPU.

Usage: python xla_checks.py OUT_JSON FOLDER MODE [MODE ...]. The modes run in this one process,
in the order given (each start of torch_xla costs seconds); OUT_JSON gets what each measured,
by mode, and the tests assert on it. FOLDER takes the checkpoints.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path

import torch

import scopedlite as lite
from scopedlite._hardware.machine import Machine

STEPS = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def train(accelerator: str, precision: str = "32-true") -> dict:
    """The unchanged loop: setup, setup_dataloader, backward, step."""
    with lite.launch(accelerator=accelerator, precision=precision) as run:
        model = make_model()
        model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = lite.setup_dataloader(make_loader())
        losses = []
        batch_device = None
        for _ in range(STEPS // len(loader) + 1):
            for x, y in loader:
                batch_device = x.device.type
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).float(), y)
                opt.zero_grad()
                lite.backward(loss)
                opt.step()
                losses.append(loss.item())
        params = {k: v.detach().float().cpu().tolist() for k, v in model.state_dict().items()}
        return {
            "strategy": run.strategy.name,
            "device": str(run.device),
            "param_device": next(model.parameters()).device.type,
            "param_dtype": str(next(model.parameters()).dtype),
            "batch_device": batch_device,
            "losses": losses,
            "params": params,
        }


def plain_torch() -> dict:
    """The reference: the same loop in plain torch, one process, no scopedlite."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader()
    losses = []
    for _ in range(STEPS // len(loader) + 1):
        for x, y in loader:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().tolist() for k, v in model.state_dict().items()}}


def mode_train(checkpoint: str) -> dict:
    # XLA first: torch's autograd engine sizes its per-device queues at its first backward, so
    # a backward before torch_xla is imported leaves no queue for XLA (see _XLABase.backward).
    xla = train("tpu")
    bf16 = train("xla", "bf16-true")
    feed = feed_checks(checkpoint)
    return {
        "plain": plain_torch(),
        "cpu": train("cpu"),
        "xla": xla,
        "bf16": bf16,
        "bf16_mixed": autocast_dtypes(),
        "feed": feed,
    }


class Recorded(torch.utils.data.Dataset):
    """Samples ``(x[i], i)``; notes in which thread each was read and whether that thread saw
    the run (``lite.current().launched``); raises at index ``fail_at``."""

    def __init__(self, fail_at: int = -1) -> None:
        self.x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3))
        self.fail_at = fail_at
        self.reads: set = set()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        thread = "main" if threading.current_thread() is threading.main_thread() else "other"
        self.reads.add((thread, lite.current().launched))
        if i == self.fail_at:
            raise ValueError(f"bad sample {i}")
        return self.x[i], i


def shuffled(dataset: torch.utils.data.Dataset) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7))


def feed_checks(checkpoint: str) -> dict:
    """A set-up loader under xla_single: where its batches are read and arrive, the step marks
    of a pass, the epochs, a pass saved after 3 batches and resumed in a new launch, a loop
    left early, and an error raised while reading."""
    import torch_xla.debug.metrics as met

    out: dict = {}
    with lite.launch(accelerator="tpu"):
        dataset = Recorded()
        loader = lite.setup_dataloader(shuffled(dataset))
        marks = met.counter_value("MarkStep") or 0
        epoch0 = []
        for x, i in loader:  # reading only: no optimizer step ends a graph
            out["batch_device"] = x.device.type
            epoch0.append(i.cpu().tolist())
        out["marks_in_a_pass"] = (met.counter_value("MarkStep") or 0) - marks
        out["reads"] = sorted(dataset.reads)
        batches = iter(loader)  # epoch 1, left after 3 batches and saved
        epoch1_head = [next(batches)[1].cpu().tolist() for _ in range(3)]
        lite.save(checkpoint, {"loader": loader})
        epoch1_rest = [i.cpu().tolist() for _, i in batches]
        threads = threading.active_count()
        for _ in lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=1)):
            break  # left at once, with more batches (64) than XLA's loader reads ahead (24)
        gc.collect()
        out["threads_left_after_break"] = threading.active_count() - threads
    with lite.launch(accelerator="tpu"):
        resumed = lite.setup_dataloader(shuffled(Recorded()))
        lite.load(checkpoint, {"loader": resumed})
        out["resumed"] = [i.cpu().tolist() for _, i in resumed]
        out["after_resumed"] = [i.cpu().tolist() for _, i in resumed]
    with lite.launch(accelerator="tpu"):
        failing = lite.setup_dataloader(torch.utils.data.DataLoader(Recorded(fail_at=20), batch_size=8))
        read = []
        try:
            for _, i in failing:
                read.append(i.cpu().tolist())
            out["error"] = None
        except ValueError as e:
            out["error"] = str(e)
        out["read_before_error"] = read
    out["epochs"] = [epoch0, epoch1_head + epoch1_rest]
    return out


def autocast_dtypes() -> list:
    """bf16-mixed on XLA: lite.autocast computes in bfloat16, parameters stay float32."""
    with lite.launch(accelerator="tpu", precision="bf16-mixed") as run:
        model = lite.setup(torch.nn.Linear(4, 4))
        x = torch.randn(2, 4, device=run.device)
        with lite.autocast():
            inside = model(x).dtype
        return [str(inside), str(model(x).dtype), str(model.weight.dtype)]


def mode_collectives() -> dict:
    """A world of one under strategy='xla': the front end's collectives, and the strategy's
    own, which go through XLA's (xm.all_reduce, xm.all_gather, xm.rendezvous)."""
    with lite.launch(accelerator="tpu", strategy="xla", devices=1) as run:
        t = torch.tensor([1.0, -2.0, 3.0], device=run.device)
        s = run.strategy
        out = {
            "strategy": s.name,
            "world_size": run.world_size,
            "front_sum": lite.all_reduce(t, "sum").cpu().tolist(),
            "front_gather": lite.all_gather(t).cpu().tolist(),
            "front_broadcast": lite.broadcast({"a": 3}, src=0),
            "xla_sum": s.all_reduce(t, "sum").cpu().tolist(),
            "xla_mean": s.all_reduce(t, "mean").cpu().tolist(),
            "xla_max": s.all_reduce(t, "max").cpu().tolist(),
            "xla_min_bool": s.all_reduce(torch.tensor([True, False], device=run.device), "min").cpu().tolist(),
            "xla_gather": s.all_gather(t).cpu().tolist(),
            "input_after": t.cpu().tolist(),
        }
        s.barrier()
        lite.barrier()
        out["barrier"] = True
        try:
            with lite.join():
                pass
        except RuntimeError as e:
            out["join_refused"] = str(e)
        return out


def mode_save_load(path: str) -> dict:
    with lite.launch(accelerator="tpu"):
        model = lite.setup(make_model())
        opt = lite.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
        for x, y in lite.setup_dataloader(make_loader()):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            lite.backward(loss)
            opt.step()
        lite.save(path, {"model": model, "opt": opt, "step": 8})
        saved = {k: v.detach().cpu() for k, v in model.state_dict().items()}

        fresh = lite.setup(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
        fresh_opt = lite.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=0.01))
        state = {"model": fresh, "opt": fresh_opt, "step": 0}
        lite.load(path, state)
        restored = {k: v.detach().cpu() for k, v in fresh.state_dict().items()}
        opt_state_device = next(iter(fresh_opt.state.values()))["exp_avg"].device.type
    on_disk = torch.load(path, map_location=None, weights_only=True)
    return {
        "saved": {k: v.tolist() for k, v in saved.items()},
        "restored": {k: v.tolist() for k, v in restored.items()},
        "step": state["step"],
        "disk_devices": sorted({v.device.type for v in on_disk["model"].values()}),
        "disk_opt_devices": sorted(
            {t.device.type for s in on_disk["opt"]["state"].values() for t in s.values() if isinstance(t, torch.Tensor)}
        ),
        "fresh_device": next(fresh.parameters()).device.type,
        "opt_state_device": opt_state_device,
    }


def mode_backward_before_import() -> dict:
    """A CPU backward before torch_xla is imported leaves autograd without an XLA queue. First,
    in this process where nothing imported torch_xla yet: what probing the machine (as launch
    does) counts under each PJRT_DEVICE, and whether it imported torch_xla."""
    probed = {}
    for pjrt in ("TPU", "CPU"):  # CPU last: the launch below runs on XLA:CPU
        os.environ["PJRT_DEVICE"] = pjrt
        probed[pjrt] = [Machine.probe().xla_device_count, "torch_xla" in sys.modules]
    torch.nn.Linear(2, 1)(torch.randn(3, 2)).sum().backward()
    with lite.launch(accelerator="tpu") as run:
        model = lite.setup(torch.nn.Linear(2, 1))
        try:
            lite.backward(model(torch.randn(3, 2, device=run.device)).sum())
        except RuntimeError as e:
            return {"error": str(e), "probed": probed}
    return {"error": None, "probed": probed}


def main() -> None:
    out, folder, modes = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    runs = {
        "train": lambda: mode_train(str(folder / "loader.pt")),
        "collectives": mode_collectives,
        "save_load": lambda: mode_save_load(str(folder / "ckpt.pt")),
        "backward_before_import": mode_backward_before_import,
    }
    unknown = [m for m in modes if m not in runs]
    if unknown or not modes:
        raise SystemExit(f"unknown or no modes {unknown!r}: choose from {sorted(runs)}")
    result = {mode: runs[mode]() for mode in modes}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
