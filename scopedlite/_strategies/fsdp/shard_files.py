"""A sharded state dict saved by one rank is loaded where it was saved, or refused.

Under fsdp and model_parallel ``model.state_dict()`` holds DTensors: each rank's own shard of
each parameter. A DDP script saves it from rank 0 alone (``if rank == 0:
torch.save(model.state_dict(), path)``) and loads the file on every rank to resume. A
DTensor's pickle keeps the saving rank's shard and not whose it is, so every rank loaded rank
0's shard into its own place: the parameters came out wrong on every rank, with no error.

So each sharded DTensor that the set-up model's ``state_dict()`` returns carries the mesh
coordinate of the rank that holds it. It is an attribute, and it travels in the file: a
tensor subclass pickles its ``__dict__``, and ``torch.load``'s default ``weights_only`` load
restores it. The set-up model's ``load_state_dict`` refuses a shard saved at another
coordinate on the rank it would mislead, naming the ways out. A plain ``torch.load``
elsewhere sees an attribute it never reads. Parameters themselves (``keep_vars=True``) are
left untouched.

The set-up optimizer's ``state_dict()`` has the same trap (each rank's shards of ``exp_avg``
and the like) and the same mark. There the values are the optimizer's live state tensors, so
the mark goes on a ``detach()``-ed twin (same storage, a new tensor object) in the returned
dict, never on the optimizer's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from scopedlite._core.dtensors import is_dtensor, is_whole

__all__ = [
    "refuse_other_ranks_optimizer_shards",
    "refuse_other_ranks_shards",
    "tag_optimizer_shards",
    "tag_shards",
]

_TAG = "_scopedlite_shard_of"


def _where(dtensor: Any) -> tuple[int, ...]:
    """This rank's coordinate on each mesh dimension ``dtensor`` is split over (-1: replicated).

    Found from the mesh's ranks: a mesh read back from a file answers ``get_coordinate()``
    with the saving rank's coordinate."""
    found = (dtensor.device_mesh.mesh == dist.get_rank()).nonzero()
    coordinate = found[0].tolist() if len(found) else [-1] * len(dtensor.placements)
    return tuple(-1 if p.is_replicate() else c for c, p in zip(coordinate, dtensor.placements, strict=True))


def _sharded(value: Any) -> bool:
    return is_dtensor(value) and not isinstance(value, torch.nn.Parameter) and not is_whole(value)


def tag_shards(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A model's state-dict post-hook: mark each shard with the coordinate it was taken at."""
    for value in state_dict.values():
        if _sharded(value):
            setattr(value, _TAG, _where(value))


def tag_optimizer_shards(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state-dict post-hook: the same mark, on twins of its live state tensors
    (``state_dict["state"]`` is a new dict; each entry in it is the optimizer's own, so it is
    replaced, not changed)."""
    state = state_dict["state"]
    for key, entry in state.items():
        if any(_sharded(value) for value in entry.values()):
            state[key] = {name: _marked_twin(value) if _sharded(value) else value for name, value in entry.items()}
    return state_dict


def _marked_twin(value: Any) -> Any:
    twin = value.detach()
    setattr(twin, _TAG, _where(value))
    return twin


def refuse_other_ranks_shards(module: torch.nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    """A model's load pre-hook: refuse a shard that another rank saved (see the module docstring)."""
    for key, value in state_dict.items():
        _refuse_if_moved("model", repr(key), value, "{'model': model}")


def refuse_other_ranks_optimizer_shards(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    """An optimizer's load pre-hook: the same refusal for its state."""
    for key, entry in state_dict.get("state", {}).items():
        for name, value in entry.items():
            _refuse_if_moved(
                "optimizer", f"{name!r} of parameter {key!r}", value, "{'model': model, 'optimizer': optimizer}"
            )


def _refuse_if_moved(owner: str, what: str, value: Any, pair: str) -> None:
    saved = getattr(value, _TAG, None) if is_dtensor(value) else None
    if saved is None or tuple(saved) == _where(value):
        return
    raise ValueError(
        f"{owner}.load_state_dict got {what} as the shard another rank held (mesh coordinate "
        f"{tuple(saved)}; this rank holds {_where(value)}): under a sharded strategy "
        f"{owner}.state_dict() is each rank's own shards, so a file written by one rank "
        f"(`if rank == 0: torch.save({owner}.state_dict(), path)`) would put that rank's shard "
        f"in every rank's place. Save the whole state with `lite.save(path, {pair})` and resume "
        f"with `lite.load(path, {pair})`, or have every rank save its own state dict to its own "
        "path and load that one."
    )
