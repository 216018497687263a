"""Our collectives inside a ``lite.join`` session, and what the session shares with them.

``NoJoin`` (one process): nothing.

``JoinCollectives``: ``lite.all_reduce``/``all_gather``/``broadcast``/``barrier`` once some
rank serves (``session.py``). The session announces each one in a round whose step messages carry
its :class:`~message.Header` (kind, op, dtype, shape, source) and its call site; the
running ranks have checked there that they all asked for the same thing, from the same
line. Then the payload travels, and the ranks that serve take part with a neutral value:
zero for sums and means, -inf/+inf (or the dtype's limits) for max/min, rows that are
dropped for gathers. A mean divides by the number of running ranks.

Because a serving rank learns from each round what comes next, our collectives may sit
anywhere in the loop and a rank with no batch at all works too. torch's ``Join`` gets these
wrong: a rank that joined answers only its joinables' hooks, so a collective of the user's in
the loop is matched against one of Join's own (a wrong value, then an abort).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from scopedlite._comm.debug import PACKAGE_DIR
from scopedlite._comm.payloads import keep
from scopedlite._comm.replicas import one_per_replica
from scopedlite._comm.wire import (
    DTYPES,
    MAX_DIMS,
    TORCH_OPS,
    from_bytes,
    neutral_value,
    to_bytes,
    wire_dtype,
)
from scopedlite._strategies.base import REDUCE_OPS
from scopedlite._strategies.join.message import BARRIER, BROADCAST, GATHER, REDUCE, Header

if TYPE_CHECKING:
    from scopedlite._strategies.join.message import Round

__all__ = [
    "JoinCollectives",
    "NoJoin",
    "PEER_LEFT",
    "PeerLeftJoinError",
    "refuse_distributed_norms",
    "refuse_raw_collectives",
]

_TENSOR, _BYTES = 1, 2

PEER_LEFT = (
    "Another rank left lite.join by an exception (its own error says which and why), so the "
    "ranks can no longer run the block's collectives together. This rank stops here too; "
    "end the run, or leave the launch block, rather than continue the loop."
)


class PeerLeftJoinError(RuntimeError):
    """Another rank left a ``lite.join`` block by an exception."""


class NoJoin(contextlib.nullcontext):  # type: ignore[type-arg]
    """One process has nothing to wait for."""

    def loader_pass(self, length: int | None) -> None:
        return None

    def shares_every_step(self) -> bool:
        return False


class JoinCollectives:
    """The payload side of our collectives inside a join session.

    Args:
        announce: Opens the round of a collective on a running rank and returns it.
        rank: This rank.
        world_size: The number of ranks.
        device: Where payloads travel (the strategy's comm device).
    """

    def __init__(self, announce: Callable[[Header], Round], rank: int, world_size: int, device: torch.device) -> None:
        self.announce = announce
        self.rank = rank
        self.world_size = world_size
        self.device = device

    # -- a running rank ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        original = tensor
        work = tensor.detach().to(device=self.device, dtype=wire_dtype(tensor.dtype, op), copy=True)
        round_ = self.announce(Header(REDUCE, REDUCE_OPS.index(op), *_describe_tensor(work)))
        dist.all_reduce(work, op=TORCH_OPS[op])
        keep(work)  # freed here, not by gloo's thread (_comm/payloads.py)
        if op == "mean":
            work = work / len(round_.runners)
        elif original.dtype == torch.bool:
            work = work.bool()
        return work.to(original.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        rows, _ = self._gathered(tensor)
        return rows

    def all_gather_replicas(self, tensor: torch.Tensor, replicas: tuple[int, ...]) -> torch.Tensor:
        """One row per running replica (``_comm/replicas.py``); ``replicas``: each rank's."""
        rows, runners = self._gathered(tensor)
        return one_per_replica(rows, runners, replicas)

    def _gathered(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The running ranks' ``tensor``, stacked in rank order, and those ranks."""
        work = tensor.detach().to(self.device).contiguous()
        round_ = self.announce(Header(GATHER, 0, *_describe_tensor(work)))
        parts = [torch.empty_like(work) for _ in range(self.world_size)]
        dist.all_gather(parts, work)
        keep(work, *parts)
        runners = list(round_.runners)
        return torch.stack([parts[r] for r in runners]).to(tensor.device), runners

    def broadcast(self, obj: Any, src: int) -> Any:
        payload: torch.Tensor | None = None
        kind = _TENSOR
        if self.rank == src:
            if isinstance(obj, torch.Tensor) and obj.dim() <= MAX_DIMS and obj.dtype in DTYPES:
                payload = obj.detach().to(self.device).contiguous().clone()
            else:
                payload = to_bytes(obj).to(self.device)
                kind = _BYTES
        described = _describe_tensor(payload) if payload is not None else (0, ())
        round_ = self.announce(Header(BROADCAST, 0, described[0], described[1], src, kind))
        if src not in round_.runners:
            raise RuntimeError(
                f"lite.broadcast(src={src}) inside lite.join: rank {src} has already run out of "
                "data and left the join block, so it cannot send. Broadcast from a rank that "
                "stays active (e.g. before the loop), or after the join block."
            )
        source = round_.steps[src].header
        if payload is None:
            payload = torch.empty(source.shape, dtype=source.torch_dtype, device=self.device)
        dist.broadcast(payload, src=src)
        keep(payload)
        return from_bytes(payload) if source.payload == _BYTES else payload

    def barrier(self) -> None:
        self.announce(Header(BARRIER))

    # -- a serving rank --------------------------------------------------------------------------
    def serve(self, round_: Round) -> None:
        """Take part in the collective the running ranks announced, with a neutral value."""
        header = round_.step.header
        if header.collective == REDUCE:
            op = REDUCE_OPS[header.op]
            dtype = header.torch_dtype
            neutral = torch.full(header.shape, neutral_value(dtype, op), dtype=dtype, device=self.device)
            dist.all_reduce(neutral, op=TORCH_OPS[op])
            keep(neutral)
        elif header.collective == GATHER:
            zeros = torch.zeros(header.shape, dtype=header.torch_dtype, device=self.device)
            parts = [torch.empty_like(zeros) for _ in range(self.world_size)]
            dist.all_gather(parts, zeros)
            keep(zeros, *parts)
        elif header.collective == BROADCAST and header.src in round_.runners:
            source = round_.steps[header.src].header
            received = torch.empty(source.shape, dtype=source.torch_dtype, device=self.device)
            dist.broadcast(received, src=header.src)
            keep(received)
        # BARRIER: the round was the barrier


def _describe_tensor(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    if tensor.dim() > MAX_DIMS:
        raise ValueError(
            f"Collectives inside lite.join take tensors of at most {MAX_DIMS} dimensions, got {tensor.dim()}."
        )
    return DTYPES.index(tensor.dtype), tuple(tensor.shape)


# torch.distributed's collectives, as a user or a library (torchmetrics' compute()) calls them.
_RAW_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
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
_EQUIVALENT = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_object": "all_gather",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}


@contextlib.contextmanager
def refuse_raw_collectives() -> Any:
    """Inside ``lite.join``, a ``torch.distributed`` collective called from outside torch and
    scopedlite raises at once instead of hanging.

    The ranks that ran out of data serve the join session's rounds (``session.py``), which
    replay the models' steps and answer our collectives only; a raw collective on an active
    rank would wait for them until the timeout (30 minutes by default), silently. Calls from
    torch's own code (DDP's gradient all-reduce, FSDP's gathers), DeepSpeed's and ours go
    through as they are. Patched on the ``torch.distributed`` namespace for the block only;
    code that imported the function itself beforehand is not covered.
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


# torch functions that reach every rank through DTensor (FSDP2, model_parallel) without a
# torch.distributed call of their own: a gradient norm all-reduces over every rank.
_NORMS = ("clip_grad_norm_", "get_total_norm")


@contextlib.contextmanager
def refuse_distributed_norms() -> Any:
    """Inside ``lite.join``, ``torch.nn.utils.clip_grad_norm_`` (as nanoGPT writes it) and
    ``get_total_norm`` over DTensor gradients, and ``DTensor.full_tensor()`` of a sharded
    tensor, called from outside torch and scopedlite, raise at once instead of hanging: each
    is a collective over every rank that the ranks which ran out of data cannot mirror (they
    replay the models' steps and our calls only). Over plain tensors (ddp) a norm is local
    and goes through. Patched on ``torch.nn.utils``, ``torch.nn.utils.clip_grad`` and
    ``DTensor`` for the block only."""
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it
    if tensor_module is None:
        yield
        return
    dtensor = tensor_module.DTensor
    saved: list[tuple[Any, str, Any]] = []
    for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in _NORMS:
            original = getattr(owner, name, None)
            if original is not None and not hasattr(original, "__scopedlite_join_guard__"):
                saved.append((owner, name, original))
                setattr(owner, name, _guarded_norm(name, original, dtensor))
    saved.append((dtensor, "full_tensor", dtensor.full_tensor))
    dtensor.full_tensor = _guarded_full_tensor(dtensor.full_tensor)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _user_caller() -> Any:
    """The frame that called the guarded function, when it is outside torch, DeepSpeed and
    scopedlite (their own calls are the join protocol's to keep in step); else None."""
    caller = sys._getframe(2)
    return (
        None
        if os.path.abspath(caller.f_code.co_filename).startswith((_TORCH_DIR, PACKAGE_DIR, _DEEPSPEED_DIR))
        else caller
    )


def _unmirrorable(call: str, caller: Any, fix: str) -> RuntimeError:
    return RuntimeError(
        f"{call} was called inside lite.join (at {caller.f_code.co_filename}:{caller.f_lineno}) "
        "on DTensors (fsdp, model_parallel): it is a collective over every rank, and the ranks "
        "that have run out of data have left the loop and cannot take part, so the ranks would "
        f"wait for each other until launch(timeout=) ran out, silently. {fix}"
    )


def _guarded_norm(name: str, original: Any, dtensor: type) -> Any:
    first = "tensors" if name == "get_total_norm" else "parameters"  # torch's name for it

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not args and first not in kwargs:
            return original(*args, **kwargs)  # torch says what is missing
        tensors = args[0] if args else kwargs.pop(first)
        args = args[1:]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # a generator: once
        caller = _user_caller()
        if caller is not None and any(isinstance(t if name == "get_total_norm" else t.grad, dtensor) for t in tensors):
            raise _unmirrorable(
                f"torch.nn.utils.{name}",
                caller,
                "Use lite.clip_gradients(model, optimizer, max_norm=...) inside the block: it "
                "clips on every rank, the ones out of data too.",
            )
        return original(tensors, *args, **kwargs)

    guarded.__scopedlite_join_guard__ = True  # type: ignore[attr-defined]
    return guarded


def _guarded_full_tensor(original: Any) -> Any:
    @functools.wraps(original)
    def full_tensor(self: Any, *args: Any, **kwargs: Any) -> Any:
        caller = _user_caller()
        if caller is not None and not all(p.is_replicate() for p in self.placements):
            raise _unmirrorable("DTensor.full_tensor()", caller, "Gather it after the `with lite.join(...)` block.")
        return original(self, *args, **kwargs)

    return full_tensor


def _guarded(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        path = os.path.abspath(caller.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, PACKAGE_DIR, _DEEPSPEED_DIR)):
            ours = _EQUIVALENT.get(name)
            instead = f"use lite.{ours} inside the block (it stays correct on uneven data), or " if ours else ""
            raise RuntimeError(
                f"torch.distributed.{name} was called inside lite.join (at "
                f"{caller.f_code.co_filename}:{caller.f_lineno}). The ranks that have run out of "
                "data have left the loop and cannot take part, so the ranks would wait for each "
                "other until launch(timeout=) ran out, silently. "
                f"{instead[:1].upper() + instead[1:] if instead else ''}"
                f"{'call' if ours else 'Call'} it after the `with lite.join(...)` block: for a "
                "torchmetrics metric, `metric.update(...)` inside and `metric.compute()` after."
            )
        return original(*args, **kwargs)

    guarded.__scopedlite_join_guard__ = True  # type: ignore[attr-defined]
    return guarded
