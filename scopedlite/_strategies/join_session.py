"""What ``lite.join`` does under each kind of strategy.

``NoJoin`` (one process): nothing.

``ProcessGroupJoin``: the part of the join session every strategy over one process group
shares - our collectives stay correct after ranks run out of data. The session itself, with
its rounds and the per-strategy replay of forwards, backwards and optimizer steps, is
``ReplayJoin`` (``replay.py``); this base holds what a round of one of our collectives does
once it has been announced:

- every rank all-gathers a small header (active flag, kind, op, dtype, shape, source), the
  active ranks check that they asked for the same thing, and ranks that have left take part
  in the payload with a neutral value: zero for sums and means, -inf/+inf (or the dtype's
  limits) for max/min, rows that are dropped for gathers. A mean divides by the number of
  active ranks, which the headers tell.

Because a joined rank learns from each round what comes next, our collectives may sit
anywhere in the loop and a rank with no batch at all works too. torch's Join alone gets these
wrong (see BACKENDS.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scopedlite._comm.wire import (
    DTYPES,
    MAX_DIMS,
    TORCH_OPS,
    from_bytes,
    neutral_value,
    to_bytes,
    wire_dtype,
)

if TYPE_CHECKING:
    from scopedlite._strategies.base import Strategy

__all__ = ["ABORT", "NoJoin", "PEER_LEFT", "PeerLeftJoinError", "ProcessGroupJoin", "refuse_raw_collectives"]

_REDUCE, _GATHER, _BROADCAST, _BARRIER = 1, 2, 3, 4
_OPS = ("sum", "mean", "max", "min")
# header: active, kind, op, dtype, ndim, shape[8], src, payload kind (1 tensor, 2 bytes)
_H_ACTIVE, _H_KIND, _H_OP, _H_DTYPE, _H_NDIM, _H_SHAPE, _H_SRC, _H_PAYLOAD = 0, 1, 2, 3, 4, 5, 13, 14
_HEADER = 15
_PAYLOAD_TENSOR, _PAYLOAD_BYTES = 1, 2


# An opener count no sum of active (1) and joined (0) ranks can reach: a rank left by an exception.
ABORT = -1.0e6
PEER_LEFT = (
    "Another rank left lite.join by an exception (its own error says which and why), so the "
    "ranks can no longer run the block's collectives together. This rank stops here too; "
    "end the run, or leave the launch block, rather than continue the loop."
)


class PeerLeftJoinError(RuntimeError):
    """Another rank left a ``lite.join`` block by an exception."""


class NoJoin(contextlib.nullcontext):  # type: ignore[type-arg]
    """One process has nothing to wait for."""


class ProcessGroupJoin:
    """Our collectives inside a join session over one process group.

    A subclass announces each of our collectives to the ranks that have left
    (:meth:`_announce_collective`) and, on those ranks, calls :meth:`_shadow_ours` when one
    was announced.
    """

    strategy: Strategy
    world_size: int
    rank: int
    device: torch.device

    def _announce_collective(self) -> None:
        """Open a round that one of our collectives follows."""
        raise NotImplementedError

    def _shadow_ours(self) -> None:
        headers = self._exchange_headers(torch.zeros(_HEADER, dtype=torch.int64))
        active = headers[headers[:, _H_ACTIVE] == 1]
        first = active[0]
        kind = int(first[_H_KIND])
        if kind == _REDUCE:
            op = _OPS[int(first[_H_OP])]
            dtype = DTYPES[int(first[_H_DTYPE])]
            neutral = torch.full(_shape(first), neutral_value(dtype, op), dtype=dtype, device=self.device)
            dist.all_reduce(neutral, op=TORCH_OPS[op])
        elif kind == _GATHER:
            dtype = DTYPES[int(first[_H_DTYPE])]
            zeros = torch.zeros(_shape(first), dtype=dtype, device=self.device)
            dist.all_gather([torch.empty_like(zeros) for _ in range(self.world_size)], zeros)
        elif kind == _BROADCAST:
            src = int(first[_H_SRC])
            if headers[src, _H_ACTIVE] == 1:
                source = headers[src]
                dtype = DTYPES[int(source[_H_DTYPE])]
                dist.broadcast(torch.empty(_shape(source), dtype=dtype, device=self.device), src=src)
        # _BARRIER: the opener and the headers were the barrier

    # -- our collectives on an active rank -------------------------------------------------------
    def _open(self, kind: int, op: str = "sum", tensor: torch.Tensor | None = None, src: int = 0, payload: int = _PAYLOAD_TENSOR) -> torch.Tensor:
        self._announce_collective()
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[_H_ACTIVE], header[_H_KIND], header[_H_OP] = 1, kind, _OPS.index(op)
        header[_H_SRC], header[_H_PAYLOAD] = src, payload
        if tensor is not None:
            if tensor.dim() > MAX_DIMS:
                raise ValueError(f"Collectives inside lite.join take tensors of at most {MAX_DIMS} dimensions, got {tensor.dim()}.")
            header[_H_DTYPE], header[_H_NDIM] = DTYPES.index(tensor.dtype), tensor.dim()
            header[_H_SHAPE : _H_SHAPE + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        headers = self._exchange_headers(header)
        self._check_agreement(headers, kind)
        return headers

    def _exchange_headers(self, header: torch.Tensor) -> torch.Tensor:
        header = header.to(self.device)
        parts = [torch.empty_like(header) for _ in range(self.world_size)]
        dist.all_gather(parts, header)
        return torch.stack(parts).cpu()

    def _check_agreement(self, headers: torch.Tensor, kind: int) -> None:
        active = headers[headers[:, _H_ACTIVE] == 1]
        fields = [_H_KIND, _H_SRC] if kind == _BROADCAST else [_H_KIND, _H_OP, _H_DTYPE, _H_NDIM, *range(_H_SHAPE, _H_SHAPE + MAX_DIMS)]
        if not bool((active[:, fields] == active[0, fields]).all()):
            ranks = [int(r) for r in (headers[:, _H_ACTIVE] == 1).nonzero().flatten()]
            described = "; ".join(f"rank {r}: {_describe(headers[r])}" for r in ranks)
            raise RuntimeError(
                "The active ranks called different collectives inside lite.join: "
                f"{described}. Every rank must call the same collectives in the same order."
            )

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        original = tensor
        work = tensor.detach().to(device=self.device, dtype=wire_dtype(tensor.dtype, op), copy=True)
        headers = self._open(_REDUCE, op, work)
        active = int((headers[:, _H_ACTIVE] == 1).sum())
        dist.all_reduce(work, op=TORCH_OPS[op])
        if op == "mean":
            work = work / active
        elif original.dtype == torch.bool:
            work = work.bool()
        return work.to(original.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        work = tensor.detach().to(self.device).contiguous()
        headers = self._open(_GATHER, "sum", work)
        parts = [torch.empty_like(work) for _ in range(self.world_size)]
        dist.all_gather(parts, work)
        active = [r for r in range(self.world_size) if headers[r, _H_ACTIVE] == 1]
        return torch.stack([parts[r] for r in active]).to(tensor.device)

    def broadcast(self, obj: Any, src: int) -> Any:
        payload: torch.Tensor | None = None
        payload_kind = _PAYLOAD_TENSOR
        if self.rank == src:
            if isinstance(obj, torch.Tensor) and obj.dim() <= MAX_DIMS and obj.dtype in DTYPES:
                payload = obj.detach().to(self.device).contiguous().clone()
            else:
                payload = to_bytes(obj).to(self.device)
                payload_kind = _PAYLOAD_BYTES
        headers = self._open(_BROADCAST, "sum", payload, src=src, payload=payload_kind)
        if headers[src, _H_ACTIVE] != 1:
            raise RuntimeError(
                f"lite.broadcast(src={src}) inside lite.join: rank {src} has already run out of "
                "data and left the join block, so it cannot send. Broadcast from a rank that "
                "stays active (e.g. before the loop), or after the join block."
            )
        source = headers[src]
        if payload is None:
            payload = torch.empty(_shape(source), dtype=DTYPES[int(source[_H_DTYPE])], device=self.device)
        dist.broadcast(payload, src=src)
        if int(source[_H_PAYLOAD]) == _PAYLOAD_BYTES:
            return from_bytes(payload)
        return payload

    def barrier(self) -> None:
        self._open(_BARRIER)

    def clip_gradients(self, module: Any, optimizer: torch.optim.Optimizer, max_norm: float | None, clip_val: float | None, norm_type: float = 2.0) -> Any:
        """Clipping that needs nothing of the ranks that have left."""
        return self.strategy.clip_gradients(module, optimizer, max_norm, clip_val, norm_type=norm_type)


# torch.distributed's collectives, as a user or a library (torchmetrics' compute()) calls them.
_RAW_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
    "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier",
)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# DeepSpeed's engine talks to torch.distributed from its own files (deepspeed.comm); found
# without importing it.
_DEEPSPEED_SPEC = importlib.util.find_spec("deepspeed")
_DEEPSPEED_DIR = (
    os.path.dirname(os.path.abspath(_DEEPSPEED_SPEC.origin)) + os.sep
    if _DEEPSPEED_SPEC is not None and _DEEPSPEED_SPEC.origin
    else _TORCH_DIR
)
# The scopedlite package (this file is in scopedlite/_strategies/).
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_EQUIVALENT = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
               "all_gather_object": "all_gather", "broadcast": "broadcast", "broadcast_object_list": "broadcast",
               "barrier": "barrier", "monitored_barrier": "barrier"}


@contextlib.contextmanager
def refuse_raw_collectives() -> Any:
    """Inside ``lite.join``, a ``torch.distributed`` collective called from outside torch and
    scopedlite raises at once instead of hanging.

    The ranks that ran out of data wait in the join protocol, where only torch's joinables
    (DDP) and our collectives are answered; a raw collective on an active rank would wait for
    them until the timeout (30 minutes by default), silently. torch's own code (DDP, its Join)
    and ours go through as they are. Patched on the ``torch.distributed`` namespace for the
    block only; code that imported the function itself beforehand is not covered.
    """
    saved = {}
    for name in _RAW_COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None and not hasattr(original, "__scopedlite_join_guard__"):
            saved[name] = original
            setattr(dist, name, _guarded(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _guarded(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        path = os.path.abspath(caller.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, _OUR_DIR, _DEEPSPEED_DIR)):
            ours = _EQUIVALENT.get(name)
            instead = f"use lite.{ours} inside the block (it stays correct on uneven data), or " if ours else ""
            raise RuntimeError(
                f"torch.distributed.{name} was called inside lite.join (at "
                f"{caller.f_code.co_filename}:{caller.f_lineno}). The ranks that have run out of "
                "data have left the loop and cannot take part, so the ranks would wait for each "
                f"other until launch(timeout=) ran out, silently. {instead[:1].upper() + instead[1:] if instead else ''}"
                f"{'call' if ours else 'Call'} it after the `with lite.join(...)` block: for a "
                "torchmetrics metric, `metric.update(...)` inside and `metric.compute()` after."
            )
        return original(*args, **kwargs)

    guarded.__scopedlite_join_guard__ = True  # type: ignore[attr-defined]
    return guarded


def _shape(header: torch.Tensor) -> list[int]:
    ndim = int(header[_H_NDIM])
    return [int(v) for v in header[_H_SHAPE : _H_SHAPE + ndim]]


def _describe(header: torch.Tensor) -> str:
    kind = {_REDUCE: "all_reduce", _GATHER: "all_gather", _BROADCAST: "broadcast", _BARRIER: "barrier"}.get(int(header[_H_KIND]), "?")
    if kind == "all_reduce":
        return f"all_reduce(op={_OPS[int(header[_H_OP])]!r}, shape={tuple(_shape(header))}, dtype={DTYPES[int(header[_H_DTYPE])]})"
    if kind == "all_gather":
        return f"all_gather(shape={tuple(_shape(header))}, dtype={DTYPES[int(header[_H_DTYPE])]})"
    if kind == "broadcast":
        return f"broadcast(src={int(header[_H_SRC])})"
    return kind
