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
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

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
