"""The peak FLOP/s of common accelerators, for model FLOPs utilisation (MFU).

Dense (no structured sparsity) tensor-core peaks per device from the vendors' datasheets, by
the dtype the matrix multiplications run in. ``"tf32"`` is float32 with TF32 tensor cores
(``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision("high")``).
A device or dtype not listed has no peak: MFU then needs the user's number (a CPU has none,
since its peak depends on the cores, clock and vector units a process really gets).

Lookups are pure functions over a device's name (``torch.cuda.get_device_name``) or a TPU's
accelerator type (``TPU_ACCELERATOR_TYPE``, e.g. ``"v5litepod-8"``), so they are testable
without the device.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

__all__ = ["DTYPE_NAMES", "cuda_peak", "dtype_name", "tpu_peak"]

T = 1e12

_COLUMNS = ("float64", "float32", "tf32", "bfloat16", "float16")

# (tokens the device name must hold, then TFLOP/s in _COLUMNS' dtypes; None: not listed). The
# first entry whose tokens all appear in the name wins, so the more specific come first.
_CUDA_TABLE: tuple[tuple[str, float | None, float | None, float | None, float | None, float | None], ...] = (
    ("h200 nvl", 30, 60, 417.5, 835.5, 835.5),
    ("h200", 34, 67, 494.7, 989.4, 989.4),
    ("h100 nvl", 30, 60, 417.5, 835.5, 835.5),
    ("h100 pcie", 26, 51, 378, 756, 756),
    ("h100", 34, 67, 494.7, 989.4, 989.4),  # SXM
    ("a100", 9.7, 19.5, 156, 312, 312),
    ("l40s", None, 91.6, 183, 362, 362),
    ("l4", None, 30.3, 60, 121, 121),
    ("v100s", 8.2, 16.4, None, None, 130),
    ("v100 pcie", 7, 14, None, None, 112),
    ("v100", 7.8, 15.7, None, None, 125),  # SXM2; no bfloat16 units
    ("t4", None, 8.1, None, None, 65),
    ("mi300x", 81.7, 163.4, 653.7, 1307.4, 1307.4),
)
_CUDA: tuple[tuple[frozenset[str], Mapping[str, float]], ...] = tuple(
    (frozenset(tokens.split()), {d: float(f"{v}e12") for d, v in zip(_COLUMNS, values) if v is not None})
    for tokens, *values in _CUDA_TABLE
)

# TPU chips, bfloat16 (their matrix units' dtype), per chip; by TPU_ACCELERATOR_TYPE's prefix.
_TPU: Mapping[str, float] = {
    "v2": 45 * T,
    "v3": 123 * T,
    "v4": 275 * T,
    "v5e": 197 * T,
    "v5litepod": 197 * T,
    "v5p": 459 * T,
    "v6e": 918 * T,
}

DTYPE_NAMES: Mapping[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def dtype_name(dtype: torch.dtype, tf32: bool) -> str | None:
    """The table's name for matrix multiplications in ``dtype`` (``"tf32"`` for float32 when
    TF32 is on), or None for a dtype the table does not know."""
    name = DTYPE_NAMES.get(dtype)
    return "tf32" if name == "float32" and tf32 else name


def cuda_peak(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of the CUDA (or ROCm) device called ``device_name`` in ``dtype``, or None.

    >>> cuda_peak("NVIDIA H100 80GB HBM3", "bfloat16")
    989400000000000.0
    """
    tokens = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for needed, peaks in _CUDA:
        if needed <= tokens:
            return peaks.get(dtype)
    return None


def tpu_peak(accelerator_type: str, dtype: str) -> float | None:
    """Peak FLOP/s of one chip of a TPU of ``accelerator_type`` (``"v4-8"``), or None.

    Only bfloat16 is listed: float32 matrix multiplications on a TPU run as several bfloat16
    passes at a speed that depends on the precision asked for."""
    if dtype != "bfloat16":
        return None
    return _TPU.get(accelerator_type.lower().split("-")[0])
