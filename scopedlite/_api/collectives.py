"""The collectives users call: ``all_reduce``, ``all_gather``, ``gather_for_metrics``,
``broadcast``, ``barrier``.

They take tensors, Python numbers and nested lists/tuples/dicts of them, find the active run,
and hand each leaf to the run's strategy (or to the open ``lite.join`` session, which keeps
them correct after some ranks ran out of data). On one process they return their input and
never touch ``torch.distributed``.

Outside ``lite.join``, ``all_reduce``, ``all_gather`` and ``gather_for_metrics`` first
exchange one small row describing the call on every rank (``_comm/signature.py``), so shapes
or dtypes that differ between ranks raise on every rank, naming each rank's, instead of
delivering made-up values and aborting the process; so do calls from different lines (a
call on some ranks only meeting the others' next one of the same shape). ``broadcast``'s
receivers pass nothing of their own (its source sends a header describing what follows), so
its row holds the source rank and the line. Inside the block the session's rounds compare
what the running ranks call, once a rank has run out of data.

Outside ``lite.join`` every one of them also asks the strategy's gather ledger first
(``_strategies/lockstep.py``): a rank that would wait in it for ranks that went on past it (to
a later training forward, or the end of their block) raises ``CollectiveOnSomeRanksError`` at
once. That is a collective called under ``if run.is_global_zero:``, or the first call after
one whose lone call met another rank's next call of the same shape from the same line (a
helper called on rank 0 alone, then on every rank), which nothing can tell apart. Before,
the lone rank met the others' gradient reduction or gathers (gloo aborted the process, NCCL
hung) or waited until the timeout. It costs a store write and read per call
(``SCOPEDLITE_ORDER_CHECK=0`` turns it off, and leaves the line out of the row).
"""

from __future__ import annotations

from typing import Any

import torch

from scopedlite._api.current import current
from scopedlite._api.join import active_session
from scopedlite._api.repeats import without_repeats
from scopedlite._comm.debug import (
    call_site,
    check_same_collective,
    debug_enabled,
    describe,
    order_check_enabled,
    site_id,
)
from scopedlite._comm.signature import Call, check_same, checked_first_dims, first_dims, leaf_text
from scopedlite._core.dtensors import is_dtensor
from scopedlite._core.run import Run
from scopedlite._core.structures import map_leaves, map_tensors, structure_of
from scopedlite._strategies.base import REDUCE_OPS

__all__ = ["all_gather", "all_reduce", "barrier", "broadcast", "gather_for_metrics", "gather_rows"]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, int, float, bool))


def _target(run: Run) -> Any:
    session = active_session(run)
    return session if session is not None else run.strategy


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        return torch.tensor(value, dtype=torch.bool, device=device)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64, device=device)
    return torch.tensor(value, dtype=torch.float64, device=device)


def _back(result: torch.Tensor, original: Any) -> Any:
    if isinstance(original, torch.Tensor):
        return result
    return result.item()


def _check(run: Run, target: Any, what: str) -> None:
    if debug_enabled():
        check_same_collective(target, run.global_rank, run.strategy.comm_device, what)


def _on_every_rank(run: Run, target: Any, name: str) -> None:
    """Outside ``lite.join``, refused at once on a rank that would wait in ``lite.<name>`` for
    ranks that went on past it (the strategy's gather ledger); inside it the session's rounds
    keep the ranks' calls in order."""
    if target is run.strategy and order_check_enabled():
        run.strategy.collective_called(f"lite.{name}")


def _leaves(data: Any, call: str | None = None) -> list[Any]:
    """``data``'s leaves, in the order ``map_leaves`` walks them on every rank; for ``call``
    (``"all_reduce"``), refusing a DTensor among them."""
    leaves: list[Any] = []
    map_leaves(data, leaves.append, _is_leaf)
    if call is not None:
        _refuse_dtensors(leaves, call)
    return leaves


def _refuse_dtensors(leaves: list[Any], call: str) -> None:
    """A DTensor's value is spread over the ranks (fsdp's parameters and gradients,
    model_parallel's activations): which of it to send is the caller's to say. Refused on
    every rank that passes one, before any collective (torch would raise inside its
    dispatch, on each rank at its own moment)."""
    if not any(is_dtensor(leaf) for leaf in leaves):
        return
    raise TypeError(
        f"lite.{call} got a DTensor (a tensor sharded over the ranks, as fsdp's parameters and "
        "gradients are): which part of it to send is yours to say. Pass `t.full_tensor()` "
        "(the whole value, the same on every rank) or `t.to_local()` (this rank's shard)."
    )


def _rebuilt(data: Any, values: list[Any]) -> Any:
    """``data`` with its leaves replaced, in order, by ``values``."""
    each = iter(values)
    return map_leaves(data, lambda _: next(each), _is_leaf)


class _Shown:
    """A leaf in the error's picture of a nest: ``repr`` gives ``float32[5, 4]``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.text = leaf_text(tensor)

    def __repr__(self) -> str:
        return self.text


def _call(run: Run, kind: str, op: str | None, data: Any, tensors: list[torch.Tensor], src: int = -1) -> Call:
    """This rank's call as the ranks compare it: with the line that called it, which tells
    a call on some ranks only apart from the others' next one of the same shape."""
    where = call_site()
    return Call(
        kind,
        op,
        structure_of(data, _is_leaf),
        tuple(tensors),
        lambda: repr(_rebuilt(data, [_Shown(t) for t in tensors])),
        run.global_rank,
        site=site_id(where) if order_check_enabled() else 0,
        where=where,
        src=src,
    )


def _checked(
    run: Run, target: Any, kind: str, op: str | None, data: Any, tensors: list[torch.Tensor], src: int = -1
) -> None:
    """The per-call check of shapes (a broadcast's: its source rank) and line: outside
    ``lite.join``, and inside it while every rank has data (the session runs free, every rank
    in this call). Once a rank has run out, the session's rounds compare what the running
    ranks call instead."""
    if _checked_here(run, target):
        check_same(_call(run, kind, op, data, tensors, src), run.strategy.all_gather, run.strategy.all_reduce)


def _checked_here(run: Run, target: Any) -> bool:
    """Whether every rank is in this call, so the per-call check runs: outside ``lite.join``
    (``target`` is the strategy), or inside it while the session runs free."""
    return target is run.strategy or bool(target.in_step())


def all_reduce(data: Any, op: str = "sum") -> Any:
    """Reduce ``data`` over all ranks and return the result on every rank.

    Args:
        data: A tensor, a Python number, or nested lists/tuples/dicts of them.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    Returns:
        The same structure with every leaf reduced. The input is not modified. Numbers come
        back as numbers; on several processes a mean of ints comes back as a float. On one
        process the input itself is returned, as every collective does there.

    Under ``model_parallel`` the reduction counts each data-parallel replica once, as
    ``ddp`` counts each rank: a replica's tensor-parallel ranks read the same batches and
    must pass the same value (a ``mean`` divides by the number of replicas). It is then an
    all-gather over every rank and a reduction on each, whose cost grows with the world
    size. ``broadcast`` and ``barrier`` still span every rank.

    Raises:
        ShapeMismatchError: On every rank, where the ranks' leaves differ in shape or dtype
            (or their nests in structure), naming each rank's; ``CollectiveMismatchError``
            where their ops differ.
        ReplicaValuesDifferError: On every rank, under ``model_parallel``, where the ranks
            of one replica passed different values, naming them.
    """
    if op not in REDUCE_OPS:
        raise ValueError(
            f"op={op!r} is not a reduction scopedlite knows. Valid choices: {', '.join(map(repr, REDUCE_OPS))}."
        )
    run = current()
    if run.world_size == 1:
        return data
    target = _target(run)
    _on_every_rank(run, target, "all_reduce")
    leaves = _leaves(data, "all_reduce")
    tensors = [_reduced_form(leaf, op, run.device) for leaf in leaves]
    for tensor in tensors:
        _check(run, target, describe("all_reduce", tensor, op=op))
    _checked(run, target, "all_reduce", op, data, tensors)
    return _rebuilt(data, [_back(target.all_reduce_replicas(t, op), leaf) for t, leaf in zip(tensors, leaves)])


def _reduced_form(leaf: Any, op: str, device: torch.device) -> torch.Tensor:
    """``leaf`` as a tensor of the dtype it is reduced in: a mean of integers is a float."""
    tensor = _as_tensor(leaf, device)
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        tensor = tensor.to(torch.float64 if not isinstance(leaf, torch.Tensor) else torch.get_default_dtype())
    return tensor


def all_gather(data: Any) -> Any:
    """Gather ``data`` from all ranks, stacked on a new leading dimension of size world size.

    Numbers become tensors of shape ``(world_size,)``. Tensors must have the same shape and
    dtype on every rank: where they differ, every rank raises ``lite.ShapeMismatchError``
    naming each rank's (for batches whose length differs by rank, use
    :func:`gather_for_metrics`). On one process the input comes back with a leading
    dimension of 1. Inside ``lite.join`` the leading dimension holds the ranks still active,
    in rank order. Under ``model_parallel`` it holds each data-parallel replica once (see
    :func:`all_reduce`).
    """
    run = current()
    if run.world_size == 1:
        return map_leaves(data, lambda leaf: _as_tensor(leaf, run.device).unsqueeze(0), _is_leaf)
    target = _target(run)
    _on_every_rank(run, target, "all_gather")
    tensors = [_as_tensor(leaf, run.device) for leaf in _leaves(data, "all_gather")]
    for tensor in tensors:
        _check(run, target, describe("all_gather", tensor))
    _checked(run, target, "all_gather", None, data, tensors)
    return _rebuilt(data, [target.all_gather_replicas(t) for t in tensors])


def gather_for_metrics(data: Any) -> Any:
    """Every rank's rows of ``data``, concatenated in rank order: each sample once.

    For what evaluation gathers: per-sample predictions and targets, whose first dimension
    may differ by rank (the last batch of an epoch). Each tensor leaf of ``data`` (nested in
    lists, tuples, dicts) is concatenated along its first dimension; a Python number or a 0-d
    tensor counts as one row, so it comes back as a 1-D tensor of one value per rank. Every
    other dimension and the dtype must be the same on every rank, or every rank raises
    ``lite.ShapeMismatchError`` naming each rank's shape. On one process ``data`` comes back
    as it is (numbers and 0-d tensors as 1-D tensors of one value).

    Under ``model_parallel`` each data-parallel replica's rows come once (see
    :func:`all_reduce`). Inside ``lite.join`` the ranks that ran out of data contribute nothing, and a set-up
    loader there pads nothing, so every sample of the dataset is gathered exactly once.
    Outside it, a set-up loader pads its pass as ``DistributedSampler`` does (the last ranks'
    shares end with a repeat of a first sample, to even out the counts). The repeated rows
    are left out of a tensor gathered on the batch that holds them whose first dimension is
    that batch's length, and of one gathered after the pass whose first dimension is the
    pass's number of samples on this rank (every batch's outputs concatenated); anything
    else gathered once the repeat was handed out may hold it, and a warning says so (see
    ``_api/repeats.py``).
    """
    return gather_rows(data, leave_out_repeats=True)


def gather_rows(data: Any, leave_out_repeats: bool = False) -> Any:
    """:func:`gather_for_metrics`; for our own gathers of per-rank rows (``lite.throughput``'s
    state) without ``leave_out_repeats``: their rows are no batch's samples."""
    run = current()
    leaves = _leaves(data, "gather_for_metrics")
    tensors = [_as_tensor(leaf, run.device).reshape(1) if _is_scalar(leaf) else leaf for leaf in leaves]
    if run.world_size == 1:
        return _rebuilt(data, tensors)
    target = _target(run)
    _on_every_rank(run, target, "gather_for_metrics")
    if leave_out_repeats:
        tensors = without_repeats(run, tensors)
    for tensor in tensors:
        _check(run, target, describe("gather_for_metrics", tensor, rows_differ=True))
    call = _call(run, "gather_for_metrics", None, data, tensors)
    lengths = None
    strategy = run.strategy
    if _checked_here(run, target):
        slots = run.world_size if strategy.data_parallel_size == run.world_size else 0  # 0: only check
        lengths = checked_first_dims(call, strategy.all_gather, strategy.all_reduce, run.global_rank, slots)
    if lengths is None:  # inside lite.join's rounds, or replicas of several ranks, or too many to fit
        lengths = first_dims(call, target.all_gather_replicas)
    return _rebuilt(data, [_concatenated(target, t, [ranks[i] for ranks in lengths]) for i, t in enumerate(tensors)])


def _is_scalar(leaf: Any) -> bool:
    return not isinstance(leaf, torch.Tensor) or leaf.dim() == 0


def _concatenated(target: Any, tensor: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each replica's ``lengths[r]`` rows of ``tensor``, in order: padded to the longest,
    gathered, and cut back."""
    longest = max(lengths)
    if longest == 0:  # no rank has a row: nothing to send, and this rank's empty tensor is the result
        return tensor
    if len(tensor) < longest:
        tensor = torch.cat([tensor, tensor.new_zeros((longest - len(tensor), *tensor.shape[1:]))])
    rows = target.all_gather_replicas(tensor)
    return torch.cat([rows[r, :n] for r, n in enumerate(lengths)])


def broadcast(obj: Any, src: int = 0) -> Any:
    """Send ``obj`` from rank ``src`` to every rank; returns it on every rank.

    Receivers may pass anything (None is fine): what they pass is ignored. Tensors arrive on
    each rank's device; other objects are pickled.
    """
    run = current()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < run.world_size:
        raise ValueError(f"src={src!r} is not a rank of this run: valid ranks are 0..{run.world_size - 1}.")
    if run.world_size == 1:
        return obj
    target = _target(run)
    _on_every_rank(run, target, "broadcast")
    _check(run, target, describe("broadcast", src=src))
    _checked(run, target, "broadcast", None, None, [], src=src)  # the source rank and the line
    result = target.broadcast(obj, src)
    return map_tensors(result, lambda t: t.to(run.device))


def barrier() -> None:
    """Wait until every rank reaches this line."""
    run = current()
    if run.world_size == 1:
        return
    target = _target(run)
    _on_every_rank(run, target, "barrier")
    _check(run, target, describe("barrier"))
    target.barrier()
