"""``lite.peak_flops``: what one device can do, for MFU (``lite.throughput``).

Reads the table of ``_hardware/peak_flops.py`` for the run's device and precision.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from scopedlite._api.current import current
from scopedlite._hardware.peak_flops import cuda_peak, dtype_name, tpu_peak

__all__ = ["compute_dtype", "peak_flops"]


def compute_dtype(precision: Any) -> torch.dtype:
    """The dtype a run's matrix multiplications run in: autocast's, else the parameters'."""
    return precision.autocast_dtype or precision.param_dtype or torch.float32


def peak_flops(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> float | None:
    """The peak FLOP/s of one device, from a table of common accelerators, or None.

    Listed: NVIDIA H200, H100 (SXM, PCIe, NVL), A100, L40S, L4, V100 (SXM2, PCIe, V100S), T4,
    AMD MI300X (float64, float32, TF32, bfloat16, float16 where the device has them), and
    TPU v2, v3, v4, v5e, v5p, v6e (bfloat16, per chip, from ``TPU_ACCELERATOR_TYPE``). Dense
    peaks, without structured sparsity. A CPU, and a device or dtype not listed, give None:
    pass your own number to ``lite.throughput(peak_flops=...)`` for MFU there.

    Args:
        device: The device; None for the active run's.
        dtype: The dtype the matrix multiplications run in; None for the active run's
            precision (``"bf16-mixed"``: bfloat16). float32 on CUDA counts as TF32 when torch
            lets matmuls use it (``torch.backends.cuda.matmul.allow_tf32``).
    """
    run = current() if device is None or dtype is None else None
    device = torch.device(device) if device is not None else run.device  # type: ignore[union-attr]
    dtype = dtype if dtype is not None else compute_dtype(run.precision)  # type: ignore[union-attr]
    if device.type == "cuda":
        name = dtype_name(dtype, tf32=torch.backends.cuda.matmul.allow_tf32)
        return cuda_peak(torch.cuda.get_device_name(device), name) if name is not None else None
    if device.type == "xla":
        name = dtype_name(dtype, tf32=False)
        kind = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        return tpu_peak(kind, name) if name is not None and kind else None
    return None
