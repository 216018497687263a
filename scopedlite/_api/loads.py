"""A state dict loaded into a set-up model or optimizer on some ranks only is refused.

``if run.is_global_zero: model.load_state_dict(torch.load(path))`` resumes on rank 0 alone, as
one would before wrapping a model in torch's DDP, which broadcasts rank 0's parameters when it
is built. After ``lite.setup`` nothing sends them again: under ddp the replicas part without a
word; under ZeRO-1/2 rank 0's partition of the fp32 master weights takes the loaded values and
the others keep theirs, so the model becomes a mix of both; under fsdp rank 0's shards alone
change. An optimizer's state loaded on one rank (its momenta) parts the same way.

So the set-up model (the user's module inside it) and each set-up optimizer get a
``load_state_dict`` pre-hook, torch's public ``register_load_state_dict_pre_hook``, that checks
the call against the other ranks' steps (``every_rank.py``): on the ranks that load alone it
raises ``MethodCalledOnSomeRanksError`` before anything is loaded, naming what the others do and
the fix (load on every rank, or ``lite.load``, which every rank calls). A load on every rank
passes, and so does ``lite.load``'s own. The hooks are removed when the run ends. Not checked
inside ``lite.join`` (as every call of ``every_rank.py``), nor on one process.
"""

from __future__ import annotations

from typing import Any

import torch

from scopedlite._api.current import current
from scopedlite._api.every_rank import every_rank_calls

__all__ = ["load_together"]

_WHY = "each rank loads its own copy, or its own shard"
_ALONE = "alone it would change that rank's copy only: nothing sends it to the others, and the ranks' models part"
_FIX = (
    "Load on every rank (every rank reads the file: `model.load_state_dict(torch.load(path))` before "
    '`if run.is_global_zero:`), or use `lite.load(path, {"model": model, "opt": opt})`, which every rank calls.'
)


def load_together(*objects: Any) -> None:
    """Check each ``load_state_dict`` of ``objects`` (the user's modules of set-up models, set-up
    torch optimizers) against the other ranks until the run ends; nothing on one process."""
    run = current()
    if not run.launched or run.world_size <= 1:
        return
    seen: set[int] = set()
    for obj in objects:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        name = f"{type(obj).__name__}.load_state_dict"
        # First of the object's pre-hooks, so that every rank notes the load before another
        # hook refuses it on some (FSDP's, for a shard another rank saved: shard_files.py).
        # A module's take no ``prepend``: it is registered before the strategy sets it up.
        if isinstance(obj, torch.optim.Optimizer):
            handle = obj.register_load_state_dict_pre_hook(lambda *_, name=name: _check(name), prepend=True)
        elif isinstance(obj, torch.nn.Module):
            handle = obj.register_load_state_dict_pre_hook(lambda *_, name=name: _check(name))
        else:
            continue  # a backend's own optimizer (DeepSpeed's): not a torch one
        run.strategy.set_up.at_end(handle.remove)


def _check(name: str) -> None:
    every_rank_calls(name, _WHY, _FIX, _ALONE)
