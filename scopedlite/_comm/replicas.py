"""Each data-parallel replica counted once in the values our collectives return.

Under ``model_parallel`` one replica of the model is split over its tensor-parallel ranks,
which read the same batches: a metric computed from the replica's output is the same number
on each of them. Summed over every rank it would count each replica ``tensor_parallel``
times (21 samples counted as 42 under a 2 x 2 mesh), so ``lite.all_reduce``,
``lite.all_gather`` and ``lite.gather_for_metrics`` count replicas, as they count ranks under
``ddp``: every taking-part rank's tensor is gathered in one all-gather, the ranks of each
replica must have sent bit-identical values, and one row per replica is kept (reduced here,
the same way on every rank, for ``all_reduce``).

The ranks of a replica that sent different values (a value computed from a rank's own shard
of a tensor-parallel output, a timer) have no one value to count: every rank holds every
row, so every rank raises the same :class:`ReplicaValuesDifferError` at once, naming them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from scopedlite._comm.debug import CollectiveMismatchError

__all__ = ["ReplicaValuesDifferError", "one_per_replica", "reduce_rows"]

_SHOWN = 6  # values of a row the error shows


class ReplicaValuesDifferError(CollectiveMismatchError, ValueError):
    """The ranks of one data-parallel replica passed different values to a collective that
    counts each replica once (``model_parallel``). Raised on every rank at once."""


def one_per_replica(rows: torch.Tensor, ranks: Sequence[int], replicas: Sequence[int]) -> torch.Tensor:
    """Of ``rows`` (one per rank of ``ranks``, stacked), one per replica, in replica order.

    Args:
        rows: What each taking-part rank sent, stacked on the first dimension.
        ranks: The global rank of each row.
        replicas: The replica of every global rank (``Strategy.join_replicas``).

    Raises:
        ReplicaValuesDifferError: Where the rows of one replica are not bit-identical.
    """
    kept: dict[int, tuple[int, torch.Tensor]] = {}
    for rank, row in zip(ranks, rows):
        replica = replicas[rank]
        if replica not in kept:
            kept[replica] = (rank, row)
        elif not _same_bits(kept[replica][1], row):
            _refuse(replica, kept[replica], (rank, row))
    return torch.stack([kept[r][1] for r in sorted(kept)])


def reduce_rows(rows: torch.Tensor, op: str, original: torch.dtype) -> torch.Tensor:
    """``op`` over the first dimension of ``rows`` (one row per replica), as
    ``_comm.distributed.all_reduce_tensor`` reduces over ranks; a ``mean`` divides by the
    number of rows."""
    if op in ("sum", "mean"):
        total = rows.sum(0, dtype=rows.dtype)
        return total / len(rows) if op == "mean" else total
    result = rows.amax(0) if op == "max" else rows.amin(0)
    return result.bool() if original == torch.bool else result


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, so a replica's NaN is its ranks' common value too."""
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.bool else flat.view(torch.uint8)


def _refuse(replica: int, first: tuple[int, torch.Tensor], other: tuple[int, torch.Tensor]) -> None:
    shown = "\n".join(f"  rank {rank}: {_values(row)}" for rank, row in (first, other))
    raise ReplicaValuesDifferError(
        "lite.all_reduce, lite.all_gather and lite.gather_for_metrics count each data-parallel "
        "replica once (its tensor-parallel ranks hold one replica of the model and read the "
        f"same batches), but ranks {first[0]} and {other[0]} of replica {replica} passed "
        f"different values (or shapes):\n{shown}\n"
        "Reduce a value each rank computed from its own shard over the tensor-parallel "
        "dimension first (a DTensor's `.full_tensor()`, or `torch.distributed.all_reduce(x, "
        "group=run.strategy.mesh['tensor_parallel'].get_group())`), so that every rank of a "
        "replica passes the replica's value. For a reduction over every process instead, "
        "call torch.distributed yourself on `run.strategy.mesh`."
    )


def _values(row: torch.Tensor) -> str:
    flat = row.detach().reshape(-1).cpu()
    head = ", ".join(repr(v) for v in flat[:_SHOWN].tolist())
    return f"[{head}{', ...' if len(flat) > _SHOWN else ''}] ({str(row.dtype).removeprefix('torch.')}{list(row.shape)})"
