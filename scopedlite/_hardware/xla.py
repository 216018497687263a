"""What XLA this machine offers, found without starting the XLA runtime.

torch_xla lives in the optional extra ``scopedlite[xla]``. Each torch_xla release is built
against exactly one torch release (torch-xla 2.9.0 needs torch 2.9.0), so a mismatch is
reported from package metadata before the import, which would otherwise fail with an
undefined C++ symbol. Device detection never asks the TPU metadata server
(``torch_xla._internal.tpu.num_available_devices()`` tries it for seconds on a CPU host):
chips are counted on the PCI bus, and only when ``PJRT_DEVICE`` is unset or ``TPU``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import types
from pathlib import Path
from typing import Mapping

import torch

__all__ = ["TORCH_FOR_XLA", "import_torch_xla", "xla_device_count", "xla_import_problem"]

# The torch release the torch-xla we test against (2.9.0) is built for.
TORCH_FOR_XLA = "2.9.0"

# Google's PCI vendor id and the device ids of TPU chips (v2/v3, v4, v5e, v6e, test, 7x), as
# torch_xla 2.9's own chip count reads them: a local file read, no network.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = ("0x0027", "0x005e", "0x0063", "0x006f", "0x0056", "0x0062", "0x0076")


def _release(version: str) -> str:
    """``"2.9.0+cu128"`` -> ``"2.9.0"``."""
    return version.split("+")[0]


def xla_import_problem() -> str | None:
    """Why torch_xla cannot be used here (not installed, or built for another torch), or None.

    Reads package metadata only: importing a mismatched torch_xla fails with an obscure
    undefined-symbol error, and importing a good one costs seconds.
    """
    if importlib.util.find_spec("torch_xla") is None:
        return (
            f"XLA/TPU runs need torch_xla, which is not installed. Install the extra: "
            f"pip install scopedlite[xla] (torch-xla {TORCH_FOR_XLA} needs exactly "
            f"torch=={TORCH_FOR_XLA}; this environment has torch {torch.__version__})."
        )
    try:
        xla_version = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        return None  # a source build: nothing to compare against
    torch_release, xla_release = _release(torch.__version__), _release(xla_version)
    if torch_release != xla_release:
        return (
            f"torch_xla {xla_version} is installed with torch {torch.__version__}, but each "
            f"torch_xla release needs exactly the torch of the same version (torch=="
            f"{xla_release}). Install matching versions, e.g. pip install scopedlite[xla] "
            f"torch=={TORCH_FOR_XLA} torch-xla=={TORCH_FOR_XLA}."
        )
    return None


def import_torch_xla() -> types.ModuleType:
    """Import torch_xla, or raise an ImportError naming the extra and the torch it needs."""
    problem = xla_import_problem()
    if problem is not None:
        raise ImportError(problem)
    import torch_xla

    return torch_xla


def _tpu_chips(pci_root: Path = Path("/sys/bus/pci/devices")) -> int:
    """TPU chips attached to this host, counted on the PCI bus (no metadata server)."""
    count = 0
    try:
        devices = list(pci_root.iterdir())
    except OSError:
        return 0
    for device in devices:
        try:
            vendor = (device / "vendor").read_text().strip()
            if vendor != _GOOGLE_PCI_VENDOR:
                continue
            if (device / "device").read_text().strip() in _TPU_PCI_DEVICES:
                count += 1
        except OSError:
            continue
    return count


def xla_device_count(env: Mapping[str, str], installed: bool) -> int:
    """How many XLA devices a launch may use, decided without starting the XLA runtime.

    ``PJRT_DEVICE=CPU`` gives one XLA:CPU device (several cannot run collectives upstream);
    ``PJRT_DEVICE=TPU`` or unset counts TPU chips on the PCI bus (one process per chip);
    any other PJRT device (CUDA) is not supported by scopedlite's XLA strategies: 0.
    """
    if not installed:
        return 0
    pjrt = env.get("PJRT_DEVICE", "").upper()
    if pjrt == "CPU":
        return 1
    if pjrt in ("", "TPU"):
        return _tpu_chips()
    return 0
