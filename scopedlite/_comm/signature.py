"""Before a collective, one small exchange: every rank's shapes and dtypes, compared.

Given tensors of different sizes on different ranks, gloo reads past what each rank sent
(made-up values arrive) and then aborts the process with SIGABRT ("Received data size
doesn't match expected size"), naming no rank; tensors of the same size but another dtype
are reinterpreted silently. So ``lite.all_reduce``, ``lite.all_gather`` and
``lite.gather_for_metrics`` first exchange one int64 row per rank that describes the
whole call: which collective and op, the line that called it, the nest's structure, and each
leaf's dtype and sizes.
The row has the same length whatever the call, so this exchange always matches; a
description too long for it travels as its length and a digest. Every collective of ours
compares the rows with the same small all-reduce (the largest and smallest value of each
slot), so two different ones meeting are refused like any other difference;
``gather_for_metrics`` leaves the first dimensions out of the compared row and carries them
in its free tail, each rank's in its own slots (:func:`checked_first_dims`). Every rank
reads the same result, so on a difference every rank raises at once, before any data
travels, naming each rank's shapes and line (a second exchange, on that path only, brings the
readable descriptions).

**The line.** Collectives pair in the order the ranks call them. A call on some ranks only
(``if run.is_global_zero: lite.all_reduce(metric)``) meets the others' next collective; where
that one has the same shape (a loss logged every step), the shapes cannot tell them apart and
both would return a mix of the two. The calling line can, with the user's lines that called
it (``_comm/debug.py``: :func:`~scopedlite._comm.debug.call_site`; a helper ``reduce_mean(x)``
called on rank 0 alone runs the same line as the others' next call of it, from another
caller), so the calls are refused on every rank at once, naming each rank's line and callers,
as ``lite.join``'s rounds refuse them. The same collective written on two lines (``if rank ==
0: lite.all_reduce(a)`` / ``else: lite.all_reduce(b)``) is refused too, naming the one-line
form; ``SCOPEDLITE_ORDER_CHECK=0`` leaves the line out of the row.

``lite.broadcast`` sends the same row, with its source rank and no leaves (its receivers pass
nothing of their own): different sources (``src=rank``: every rank would send and wait until
the timeout), a broadcast on some ranks only meeting another from another line, and a
broadcast meeting another collective are refused alike.

``gather_for_metrics`` reads each rank's first dimensions from that all-reduce (from a second
exchange, an all-gather of the rows, where they do not fit in the row, under
``model_parallel``'s replicas of several ranks, and inside ``lite.join``'s rounds): tensors
whose first dimension differs by rank are then padded to the longest, gathered and cut back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from scopedlite._comm.debug import CollectiveMismatchError, calling_line
from scopedlite._comm.wire import DTYPES, TORCH_OPS, gather_objects

__all__ = ["ROW", "Call", "ShapeMismatchError", "check_same", "checked_first_dims", "first_dims"]

Gather = Callable[[torch.Tensor], torch.Tensor]  # stacks every taking-part rank's tensor, in rank order
Reduce = Callable[[torch.Tensor, str], torch.Tensor]  # (tensor, op) -> reduced over the same ranks

ROW = 64  # int64 slots of the row each rank sends: [description length, description or digest]
_KINDS = ("all_reduce", "all_gather", "gather_for_metrics", "broadcast")
_OPS = (None, *TORCH_OPS)
# Every dtype torch has, the wire's first (its codes), the rest by name: the same on every rank.
_ALL_DTYPES: tuple[torch.dtype, ...] = DTYPES + tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)} - set(DTYPES), key=str)
)
_DESCRIPTION_AT = 6  # kind, op, structure digest, number of leaves, line, src; then per leaf dtype, ndim, dims


class ShapeMismatchError(CollectiveMismatchError, ValueError):
    """The ranks called the same collective with tensors of different shapes or dtypes (or
    nests of another structure). Raised on every rank before any data travels."""


@dataclass(frozen=True)
class Call:
    """One rank's call of a collective, as the other ranks must see it.

    Args:
        kind: ``"all_reduce"``, ``"all_gather"`` or ``"gather_for_metrics"``.
        op: The reduction of an ``all_reduce``, else None.
        structure: The nest around the leaves (``structures.structure_of``).
        tensors: The leaves as they travel, in the order the nest is walked.
        shown: The nest with each leaf as :func:`leaf_text` shows it, for the error only.
        rank: This rank's global rank, to name it in the error.
        site: The :func:`~scopedlite._comm.debug.site_id` of the calling line and its
            callers (0: not compared).
        where: That line and its callers, as :func:`~scopedlite._comm.debug.call_site`
            names them, for the error only.
        src: A broadcast's source rank (-1 for the others).
    """

    kind: str
    op: str | None
    structure: str
    tensors: tuple[torch.Tensor, ...]
    shown: Callable[[], str]
    rank: int
    site: int = 0
    where: str = ""
    src: int = -1

    def description(self) -> list[int]:
        out = [
            _KINDS.index(self.kind),
            _OPS.index(self.op),
            _digest(self.structure.encode()),
            len(self.tensors),
            self.site,
            self.src,
        ]
        for tensor in self.tensors:
            out += [_ALL_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        return out

    def row(self, description: list[int]) -> torch.Tensor:
        """``[length, description..., 0...]``, or ``[length, digest, 0...]`` when too long
        to travel whole (equal lengths and digests then stand for equal descriptions)."""
        if len(description) < ROW:
            values = [len(description), *description]
        else:
            values = [len(description), _digest(",".join(map(str, description)).encode())]
        return torch.tensor(values + [0] * (ROW - len(values)), dtype=torch.int64)


def leaf_text(tensor: torch.Tensor) -> str:
    """``float32[5, 4]``: a leaf as the error shows it."""
    return f"{str(tensor.dtype).removeprefix('torch.')}[{', '.join(map(str, tensor.shape))}]"


def check_same(call: Call, gather: Gather, reduce: Reduce) -> None:
    """Raise on every rank unless every rank describes ``call`` alike.

    One all-reduce (``max``) of the row beside its negation: the ranks' rows are all equal
    exactly when, in every slot, the largest value is minus the largest negated one (the
    smallest). An all-reduce, not a gather: gloo's all-gather of a small tensor costs about
    twice its all-reduce (``benchmarks/collective_checks.py``). Only on a difference does
    ``gather`` bring each rank's description, for the error.
    """
    _compared(call, call.row(call.description()), ROW, gather, reduce)


def _compared(call: Call, row: torch.Tensor, compared: int, gather: Gather, reduce: Reduce) -> torch.Tensor:
    """The all-reduce of :func:`check_same`; raises on every rank where the first
    ``compared`` slots of ``row`` differ between ranks. Returns the slots' maxima."""
    extremes = reduce(torch.cat([row, -row]), "max")
    if not torch.equal(extremes[:compared], -extremes[ROW : ROW + compared]):
        _refuse(call, gather)
    return extremes


def checked_first_dims(
    call: Call, gather: Gather, reduce: Reduce, rank: int, world_size: int
) -> list[list[int]] | None:
    """For ``gather_for_metrics`` (each rank its own replica: ``rank`` of ``world_size``): the
    check of :func:`check_same` - the same all-reduce as every other collective of ours, so
    that a ``gather_for_metrics`` meeting another rank's ``all_reduce`` is refused on both
    at once (an all-gather of the rows there met that all-reduce: gloo aborted) - with the
    first dimensions left out of the compared row, and each rank's first dimensions riding
    in the row's free tail, rank ``r``'s in its own slots (the others send 0 there, and the
    maximum is its value). Returns them ``[rank][leaf]``, or None where they do not fit
    (many ranks or leaves: every rank alike, then :func:`first_dims` gathers them); with
    ``world_size=0``, only the check."""
    full = call.description()
    masked = _without_first_dims(full)
    dims = _first_dims(full)
    tail = world_size * len(dims)
    fits = world_size > 0 and 1 + len(masked) + tail <= ROW
    row = call.row(masked)
    compared = ROW - tail if fits else ROW
    if fits:
        at = compared + rank * len(dims)
        row[at : at + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    extremes = _compared(call, row, compared, gather, reduce)
    if not fits:
        return None
    found = extremes[compared:ROW].view(world_size, len(dims))
    return found.tolist()  # type: ignore[no-any-return]


def first_dims(call: Call, gather: Gather) -> list[list[int]]:
    """For ``gather_for_metrics``: every taking-part rank's first dimension of each leaf
    (``[rank][leaf]``, in rank order), after checking that the ranks agree in all else."""
    description = call.description()
    rows = gather(call.row(description))
    if bool((rows[:, 0] < ROW).all()):
        descriptions = [row[1 : 1 + int(row[0])].tolist() for row in rows]
    else:  # a nest too big for a row: the descriptions themselves
        descriptions = [d for _, _, d in gather_objects((0, "", description), gather)]
    if any(_without_first_dims(d) != _without_first_dims(descriptions[0]) for d in descriptions):
        _refuse(call, gather)
    return [_first_dims(d) for d in descriptions]


def _refuse(call: Call, gather: Gather) -> None:
    """Every rank is here together: exchange what each called, and raise the same error."""
    seen = gather_objects((call.rank, call.shown(), call.description(), call.where), gather)
    table = "\n".join(
        f"  rank {rank}: {_call_text(d, shown)}" + (f" at {where}" if where else "") for rank, shown, d, where in seen
    )
    descriptions = [d for _, _, d, _ in seen]
    if len({(d[0], d[1]) for d in descriptions}) > 1:
        raise CollectiveMismatchError(
            f"The ranks called different collectives at the same point:\n{table}\n"
            "Every rank must call the same collectives, with the same op, in the same order."
        )
    if len({d[5] for d in descriptions}) > 1:
        raise CollectiveMismatchError(
            f"The ranks called lite.broadcast with different source ranks:\n{table}\n"
            "Every rank names the same source: `obj = lite.broadcast(obj, src=0)` on every "
            "rank (what the other ranks pass is ignored)."
        )
    if len({d[4] for d in descriptions}) > 1:
        if len({calling_line(where) for _, _, _, where in seen}) == 1:
            raise CollectiveMismatchError(
                f"The ranks called lite.{call.kind} from the same line through different callers:\n"
                f"{table}\n{_CALLERS_FIX}"
            )
        raise CollectiveMismatchError(f"The ranks called lite.{call.kind} from different lines:\n{table}\n{_LINES_FIX}")
    if len({(d[2], d[3]) for d in descriptions}) > 1:
        what, fix = (
            "nests of a different structure",
            "Pass the same containers, with the same keys in the same order, on every rank.",
        )
    elif len({tuple(_dtypes(d)) for d in descriptions}) > 1:
        what, fix = (
            "different dtypes",
            "Cast to one dtype on every rank first (`x.float()`; `float(n)` for a Python number).",
        )
    else:
        what, fix = "different shapes", _shape_fix(call.kind)
    raise ShapeMismatchError(
        f"lite.{call.kind} was called with {what} on different ranks, so the ranks cannot "
        f"exchange them (torch.distributed would deliver made-up values or abort the process):\n"
        f"{table}\n{fix}"
    )


_LINES_FIX = (
    "Collectives pair in the order the ranks call them, so these calls would have exchanged "
    "each other's values. Usually one of them runs on some ranks only (inside `if "
    "run.is_global_zero:`) and met the others' next collective: call it on every rank and use "
    "the result on one (`total = lite.all_reduce(x)` everywhere, then `if run.is_global_zero: "
    "print(total)`). Where the ranks pass different values to one collective, call it from one "
    "line: `lite.all_reduce(a if rank == 0 else b)`. SCOPEDLITE_ORDER_CHECK=0 turns this check off."
)


_CALLERS_FIX = (
    "Collectives pair in the order the ranks call them, so these calls would have exchanged "
    "each other's values. Usually a function that calls a collective (`reduce_mean(acc)`) ran "
    "on some ranks only (inside `if run.is_global_zero:`) and met the others' next call of it: "
    "call it on every rank and use the result on one. Where the ranks pass different values, "
    "call it from one line: `reduce_mean(a if rank == 0 else b)`. SCOPEDLITE_ORDER_CHECK=0 "
    "turns this check off."
)


def _shape_fix(kind: str) -> str:
    if kind == "gather_for_metrics":
        return (
            "lite.gather_for_metrics lets the first dimension differ between ranks; every other "
            "dimension must be the same on every rank (pad them to a common size)."
        )
    instead = {
        "all_gather": "Pad to a common shape on every rank,",
        "all_reduce": "Reduce tensors of one shape on every rank (e.g. per-rank totals: `x.sum()` and `len(x)`),",
    }[kind]
    return (
        f"{instead} or use lite.gather_for_metrics(x) for per-rank batches of different lengths "
        "(the last batch of an epoch)."
    )


def _call_text(description: list[int], shown: str) -> str:
    """``lite.all_reduce(op='sum') of float32[2]``, ``lite.broadcast(src=0)``: a rank's call."""
    kind = _KINDS[description[0]]
    if kind == "broadcast":
        return f"lite.broadcast(src={description[5]})"
    return f"lite.{kind}{_op_text(description[1])} of {shown}"


def _op_text(code: int) -> str:
    return f"(op={_OPS[code]!r})" if _OPS[code] is not None else ""


def _leaves(description: list[int]) -> list[tuple[int, list[int]]]:
    leaves, at = [], _DESCRIPTION_AT
    for _ in range(description[3]):
        dtype, ndim = description[at], description[at + 1]
        leaves.append((dtype, description[at + 2 : at + 2 + ndim]))
        at += 2 + ndim
    return leaves


def _dtypes(description: list[int]) -> list[int]:
    return [dtype for dtype, _ in _leaves(description)]


def _without_first_dims(description: list[int]) -> list[int]:
    """``description`` with each leaf's first dimension 0, its length kept: what the ranks
    of a ``gather_for_metrics`` must agree on."""
    out = description[:_DESCRIPTION_AT]
    for dtype, dims in _leaves(description):
        out += [dtype, len(dims), *([0, *dims[1:]] if dims else [])]
    return out


def _first_dims(description: list[int]) -> list[int]:
    return [dims[0] for _, dims in _leaves(description)]


def _digest(data: bytes) -> int:
    """56 bits of BLAKE2b: non-negative in an int64, the same in every process (``hash()``
    of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "big")
