"""XLA: ``accelerator="tpu"`` / ``"xla"``, the strategies ``xla_single`` and ``xla``.

torch_xla needs its own torch (torch-xla 2.9.0 needs exactly torch 2.9.0), so the runs go to a
second interpreter: ``SCOPEDLITE_XLA_PYTHON`` names a venv's python with torch 2.9.0,
torch-xla 2.9.0 and this package (``.ci/run`` builds one, once per machine, before the
tests). Those tests run real XLA:CPU (``PJRT_DEVICE=CPU``, one device). Without the variable
they are skipped, saying so; set to something that is not an executable, they fail. The
multi-device path needs TPU chips and is skipped here with that reason.

The resolver tests and the missing-extra error run in the main venv, where torch_xla is not
installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import scopedlite as lite
from scopedlite._hardware.machine import Machine
from scopedlite._hardware.xla import (
    TORCH_FOR_XLA,
    _tpu_chips,
    xla_device_count,
    xla_import_problem,
)
from scopedlite._plan import resolve
from scopedlite._strategies.xla.strategy import XLAStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from _common import assert_close, max_diff

SCRIPT = Path(__file__).resolve().parent / "scripts" / "xla_checks.py"
REPO = Path(__file__).resolve().parent.parent
XLA_PYTHON = os.environ.get("SCOPEDLITE_XLA_PYTHON", "")

needs_xla_python = pytest.mark.skipif(
    not XLA_PYTHON,
    reason="needs SCOPEDLITE_XLA_PYTHON: a python with torch==2.9.0, torch-xla==2.9.0 and "
    "scopedlite (.ci/run builds one in ~/.cache/scopedlite/xla-venv before the tests)",
)


def run_xla(tmp_path: Path, *modes: str) -> dict:
    """Run ``modes`` of ``scripts/xla_checks.py`` in one process of the XLA venv; what each
    measured, by mode."""
    # Set but unusable is a broken set-up (CI's venv build went wrong): fail, do not skip.
    assert os.access(XLA_PYTHON, os.X_OK), f"SCOPEDLITE_XLA_PYTHON={XLA_PYTHON!r} is not an executable python"
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SCOPEDLITE_", "TPU_"))}
    env.update({"PJRT_DEVICE": "CPU", "PYTHONPATH": str(REPO)})
    proc = subprocess.run(
        [XLA_PYTHON, str(SCRIPT), str(out), str(tmp_path), *modes],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


# -- under the XLA venv, on XLA:CPU ---------------------------------------------------------
@pytest.fixture(scope="module")
def xla_run(tmp_path_factory):
    """One XLA process for the checks that can share it (each start of torch_xla costs
    seconds): training on XLA and on CPU with the loader checks, collectives, a checkpoint."""
    return run_xla(tmp_path_factory.mktemp("xla"), "train", "collectives", "save_load")


@needs_xla_python
@pytest.mark.timeout(300)
def test_single_device_xla_trains_and_matches_cpu(xla_run):
    result = xla_run["train"]
    cpu, xla, bf16 = result["plain"], result["xla"], result["bf16"]  # plain torch: the reference
    assert result["cpu"]["strategy"] == "single" and result["cpu"]["param_device"] == "cpu"
    # lite on CPU: plain torch's numbers (1e-6: the run may use another thread count)
    assert_close(result["cpu"]["losses"], cpu["losses"], 1e-6, "lite on CPU: the losses")
    assert_close(result["cpu"]["params"], cpu["params"], 1e-6, "lite on CPU: the parameters")
    assert xla["strategy"] == "xla_single"
    assert xla["device"] == "xla:0" and xla["param_device"] == "xla" and xla["batch_device"] == "xla"
    assert len(cpu["losses"]) == 16  # two epochs of 8 batches
    # It trains: the second epoch's mean loss is below the first's (same batches, in order).
    assert sum(xla["losses"][8:]) < sum(xla["losses"][:8]) - 0.4
    assert_close(xla["losses"], cpu["losses"], 1e-4, "xla: the losses")
    assert_close(xla["params"], cpu["params"], 1e-4, "xla: the parameters")
    # bf16-true: parameters in bfloat16 on the XLA device, and it still learns.
    assert bf16["param_dtype"] == "torch.bfloat16" and bf16["param_device"] == "xla"
    assert sum(bf16["losses"][8:]) < sum(bf16["losses"][:8]) - 0.4
    assert_close(bf16["losses"], cpu["losses"], 0.05, "bf16-true: the losses")
    assert result["bf16_mixed"] == ["torch.bfloat16", "torch.float32", "torch.float32"]


@needs_xla_python
@pytest.mark.timeout(300)
def test_set_up_loader_feeds_through_xla_parallel_loader(xla_run):
    import torch

    feed = xla_run["train"]["feed"]
    # Read in XLA's loader thread (not the training loop's), in the run's scopes, and handed
    # out on the device after a step mark each: 8 batches, 8 marks at least, with no
    # optimizer step in the loop.
    assert feed["reads"] == [["other", True]]
    assert feed["batch_device"] == "xla"
    assert feed["marks_in_a_pass"] >= 8
    # Epochs and the resume cursor as under every strategy, against plain torch: a
    # DataLoader with the same generator, iterated epoch after epoch.
    reference = torch.utils.data.DataLoader(
        list(range(64)), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    epochs = [[batch.tolist() for batch in reference] for _ in range(3)]
    assert feed["epochs"] == epochs[:2] and epochs[0] != epochs[1]
    assert feed["resumed"] == epochs[1][3:]  # saved after 3 batches of epoch 1, resumed anew
    assert feed["after_resumed"] == epochs[2]
    # A loop left early leaves no reading or copying thread behind.
    assert feed["threads_left_after_break"] == 0
    # An error while reading is raised after the batches before it, not taken for the end.
    assert feed["error"] == "bad sample 20"
    assert feed["read_before_error"] == [list(range(0, 8)), list(range(8, 16))]


@needs_xla_python
@pytest.mark.timeout(300)
def test_xla_collectives_in_a_world_of_one(xla_run):
    result = xla_run["collectives"]
    t = [1.0, -2.0, 3.0]
    assert result["strategy"] == "xla" and result["world_size"] == 1
    assert result["front_sum"] == t
    assert result["front_gather"] == [t]
    assert result["front_broadcast"] == {"a": 3}
    # The strategy's own collectives, through xm.all_reduce / xm.all_gather on one device.
    assert result["xla_sum"] == t and result["xla_mean"] == t and result["xla_max"] == t
    assert result["xla_min_bool"] == [True, False]
    assert result["xla_gather"] == [t]
    assert result["input_after"] == t
    assert result["barrier"] is True
    assert "lite.join is not available under strategy='xla'" in result["join_refused"]


@needs_xla_python
@pytest.mark.timeout(300)
def test_xla_save_load_round_trip(xla_run):
    result = xla_run["save_load"]
    assert max_diff(result["restored"], result["saved"], "the loaded parameters") == 0.0
    assert result["step"] == 8
    assert result["disk_devices"] == ["cpu"]  # xm.save semantics: written from CPU
    assert result["disk_opt_devices"] == ["cpu"]
    assert result["fresh_device"] == "xla" and result["opt_state_device"] == "xla"


@needs_xla_python
@pytest.mark.timeout(300)
def test_backward_before_torch_xla_is_explained(tmp_path):
    # Its own process: torch_xla must not have been imported before the CPU backward.
    result = run_xla(tmp_path, "backward_before_import")["backward_before_import"]
    assert result["error"] is not None and "ran a backward before torch_xla was imported" in result["error"]
    # Probing the machine, as launch does, found the real torch_xla without importing it.
    assert result["probed"] == {"CPU": [1, False], "TPU": [_tpu_chips(), False]}


@pytest.mark.skipif(
    _tpu_chips() < 2,
    reason=(
        "needs a TPU: strategy='xla' with several processes binds one TPU chip per process, "
        "and XLA:CPU cannot run collectives across processes upstream"
    ),
)
@pytest.mark.timeout(300)
def test_multi_device_tpu(tmp_path):  # pragma: no cover - runs on TPU hosts only
    code = (
        "import torch, scopedlite as lite\n"
        "with lite.launch(accelerator='tpu', strategy='xla', devices=2) as run:\n"
        "    t = torch.tensor([float(run.global_rank + 1)], device=run.device)\n"
        "    total = lite.all_reduce(t, 'sum').cpu().item()\n"
        "    assert total == 3.0, total\n"
        "    lite.barrier()\n"
    )
    python = XLA_PYTHON or sys.executable
    proc = subprocess.run(
        [python, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PJRT_DEVICE": "TPU"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


# -- the main venv: no torch_xla --------------------------------------------------------------
def test_missing_extra_names_the_extra_and_the_torch_it_needs():
    if xla_import_problem() is None:
        pytest.skip("torch_xla is installed in this interpreter")
    with pytest.raises(ImportError, match=r"pip install scopedlite\[xla\]") as info, lite.launch(accelerator="tpu"):
        pass  # pragma: no cover
    assert f"torch=={TORCH_FOR_XLA}" in str(info.value)
    assert "accelerator='tpu'" in str(info.value)


def test_mismatched_torch_is_named(monkeypatch):
    import importlib.metadata
    import importlib.util

    from scopedlite._hardware import xla as _xla

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "torch_xla" else None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.9.0")
    monkeypatch.setattr(_xla.torch, "__version__", "2.13.0+cpu")
    problem = _xla.xla_import_problem()
    assert problem is not None and "torch_xla 2.9.0" in problem and "torch 2.13.0+cpu" in problem
    assert "torch==2.9.0" in problem
    with pytest.raises(ImportError, match="torch==2.9.0"):
        _xla.import_torch_xla()


def test_tpu_without_an_xla_device_is_refused():
    with pytest.raises(ValueError, match="no XLA device is usable"):
        resolve(accelerator="tpu", env={}, machine=Machine())
    with pytest.raises(ImportError, match=r"scopedlite\[xla\]"):
        resolve(accelerator="xla", env={}, machine=Machine(xla_problem="install scopedlite[xla]"))


def test_resolver_picks_the_xla_strategies():
    one = resolve(accelerator="tpu", env={}, machine=Machine(xla_device_count=1))
    assert (one.accelerator, one.strategy.name, one.devices, one.launcher) == ("xla", "xla_single", (0,), "none")
    assert resolve(accelerator="xla", env={}, machine=Machine(xla_device_count=1)).strategy.name == "xla_single"
    # One process per chip, each sees its chip as xla:0; forked so they run the block's body.
    four = resolve(accelerator="tpu", devices="auto", env={}, machine=Machine(xla_device_count=4, has_script=False))
    assert (four.strategy.name, four.devices, four.world_size, four.launcher) == ("xla", (0, 0, 0, 0), 4, "fork")
    assert isinstance(four.strategy, XLAStrategy)


def test_resolver_refuses_bad_xla_combinations():
    one = Machine(xla_device_count=1)
    with pytest.raises(ValueError, match=r"XLA:CPU runs one device: devices=1"):
        resolve(accelerator="tpu", devices=2, env={}, machine=one)
    with pytest.raises(ValueError, match=r"every TPU chip of the host \(4\) or one process alone"):
        resolve(accelerator="tpu", devices=2, env={}, machine=Machine(xla_device_count=4))
    with pytest.raises(ValueError, match="pass a number of devices"):
        resolve(accelerator="tpu", devices=[0], env={}, machine=one)
    with pytest.raises(ValueError, match=r"strategy='ddp' does not run on accelerator='xla'"):
        resolve(accelerator="tpu", strategy="ddp", env={}, machine=one)
    with pytest.raises(ValueError, match=r"strategy='xla' does not run on accelerator='cpu'"):
        resolve(accelerator="cpu", strategy="xla", env={}, machine=one)
    with pytest.raises(ValueError, match=r"precision='16-mixed' is not supported on XLA"):
        resolve(accelerator="tpu", precision="16-mixed", env={}, machine=one)
    with pytest.raises(ValueError, match=r"accelerator='tpux' is not valid.*'tpu', 'xla'"):
        resolve(accelerator="tpux", env={}, machine=one)


def test_device_count_follows_pjrt_device():
    assert xla_device_count({"PJRT_DEVICE": "CPU"}, installed=True) == 1
    assert xla_device_count({"PJRT_DEVICE": "CPU"}, installed=False) == 0
    assert xla_device_count({"PJRT_DEVICE": "CUDA"}, installed=True) == 0
    # TPU or unset: chips on the PCI bus (the counting is tested below), never the metadata server.
    assert xla_device_count({"PJRT_DEVICE": "TPU"}, installed=True) == _tpu_chips()
    assert xla_device_count({}, installed=True) == _tpu_chips()


@pytest.mark.parametrize("pjrt", ["CPU", "TPU", ""])
def test_probing_the_machine_never_imports_torch_xla(tmp_path, monkeypatch, pjrt):
    """What launch asks about XLA (Machine.probe) with a torch_xla installed: a stand-in whose
    import fails, so probing that imported it (and so could start the XLA runtime, or ask the
    TPU metadata server for seconds) fails here. Under the XLA venv the real torch_xla is
    checked likewise (test_backward_before_torch_xla_is_explained)."""
    (tmp_path / "torch_xla").mkdir()
    (tmp_path / "torch_xla" / "__init__.py").write_text("raise RuntimeError('torch_xla was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PJRT_DEVICE", pjrt)
    machine = Machine.probe()
    assert machine.xla_problem is None  # found installed (a source build: no metadata to compare)
    assert machine.xla_device_count == (1 if pjrt == "CPU" else _tpu_chips())
    assert "torch_xla" not in sys.modules


def test_tpu_chips_are_counted_on_the_pci_bus(tmp_path):
    for name, vendor, device in (
        ("a", "0x1ae0", "0x005e"),
        ("b", "0x1ae0", "0x005e"),
        ("c", "0x10de", "0x005e"),
        ("d", "0x1ae0", "0x0001"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device + "\n")
    assert _tpu_chips(tmp_path) == 2
    assert _tpu_chips(tmp_path / "missing") == 0
