"""The wire format our collectives share: dtype codes, neutral values, pickled payloads.

Used by the plain collectives of a process group and by the join protocol, which describe a
tensor to the other ranks in a small header before sending it. The order of :data:`DTYPES`
is part of that format.
"""

from __future__ import annotations

import ctypes
import io
import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist

from scopedlite._core.structures import map_tensors

__all__ = ["DTYPES", "MAX_DIMS", "TORCH_OPS", "from_bytes", "gather_objects", "neutral_value", "to_bytes", "wire_dtype"]

# Codes for dtypes in headers sent between ranks. Order is part of the wire format.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)

# The most dimensions a tensor described in a header may have.
MAX_DIMS = 8

# torch's reduction for each of ours ("mean" is a sum, divided afterwards).
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def wire_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    """The dtype a tensor travels in for ``op``: gloo cannot reduce bool tensors."""
    if dtype == torch.bool:
        return torch.int64 if op in ("sum", "mean") else torch.uint8
    return dtype


def to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.dump(map_tensors(obj, lambda t: t.detach().cpu()), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(payload: torch.Tensor) -> Any:
    data = payload.cpu().contiguous()
    return pickle.loads(ctypes.string_at(data.data_ptr(), data.numel()))


def gather_objects(
    obj: Any, gather: Callable[[torch.Tensor], torch.Tensor], device: torch.device | None = None
) -> list[Any]:
    """Every taking-part rank's picklable ``obj``, in rank order, through ``gather`` (a
    strategy's or join session's ``all_gather``, which stacks every rank's tensor): the
    lengths first, then the bytes padded to the longest. ``device``: where the tensors are
    handed to ``gather`` (CPU unless given)."""
    payload = to_bytes(obj).to(device)
    lengths = gather(torch.tensor([payload.numel()], dtype=torch.int64, device=device)).flatten().tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    rows = gather(padded).cpu()
    return [from_bytes(row[:n]) for row, n in zip(rows, lengths)]


def neutral_value(dtype: torch.dtype, op: str) -> float | int | bool:
    """The value a rank contributes to a reduction it takes no part in."""
    if op in ("sum", "mean"):
        return 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return float("-inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max
