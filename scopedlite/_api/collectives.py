"""The collectives users call: ``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``.

They take tensors, Python numbers and nested lists/tuples/dicts of them, find the active run,
and hand each leaf to the run's strategy (or to the open ``lite.join`` session, which keeps
them correct after some ranks ran out of data). On one process they return their input and
never touch ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

import torch

from scopedlite._api.current import current
from scopedlite._api.join import active_session
from scopedlite._comm.debug import check_same_collective, debug_enabled, describe
from scopedlite._core.run import Run
from scopedlite._core.structures import map_leaves, map_tensors
from scopedlite._strategies.base import REDUCE_OPS

__all__ = ["all_gather", "all_reduce", "barrier", "broadcast"]


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


def all_reduce(data: Any, op: str = "sum") -> Any:
    """Reduce ``data`` over all ranks and return the result on every rank.

    Args:
        data: A tensor, a Python number, or nested lists/tuples/dicts of them.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    Returns:
        The same structure with every leaf reduced. The input is not modified. Numbers come
        back as numbers; on several processes a mean of ints comes back as a float. On one
        process the input itself is returned, as every collective does there.
    """
    if op not in REDUCE_OPS:
        raise ValueError(
            f"op={op!r} is not a reduction scopedlite knows. Valid choices: {', '.join(map(repr, REDUCE_OPS))}."
        )
    run = current()
    if run.world_size == 1:
        return data
    target = _target(run)

    def reduce(leaf: Any) -> Any:
        tensor = _as_tensor(leaf, run.device)
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.to(torch.float64 if not isinstance(leaf, torch.Tensor) else torch.get_default_dtype())
        _check(run, target, describe("all_reduce", tensor, op=op))
        return _back(target.all_reduce(tensor, op), leaf)

    return map_leaves(data, reduce, _is_leaf)


def all_gather(data: Any) -> Any:
    """Gather ``data`` from all ranks, stacked on a new leading dimension of size world size.

    Numbers become tensors of shape ``(world_size,)``. Tensors must have the same shape and
    dtype on every rank. On one process the input comes back with a leading dimension of 1.
    Inside ``lite.join`` the leading dimension holds the ranks still active, in rank order.
    """
    run = current()
    if run.world_size == 1:
        return map_leaves(data, lambda leaf: _as_tensor(leaf, run.device).unsqueeze(0), _is_leaf)
    target = _target(run)

    def gather(leaf: Any) -> Any:
        tensor = _as_tensor(leaf, run.device)
        _check(run, target, describe("all_gather", tensor))
        return target.all_gather(tensor)

    return map_leaves(data, gather, _is_leaf)


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
    _check(run, target, describe("broadcast", src=src))
    result = target.broadcast(obj, src)
    return map_tensors(result, lambda t: t.to(run.device))


def barrier() -> None:
    """Wait until every rank reaches this line."""
    run = current()
    if run.world_size == 1:
        return
    target = _target(run)
    _check(run, target, describe("barrier"))
    target.barrier()
