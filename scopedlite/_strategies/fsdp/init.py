"""FSDP's ``sharded_init``: build on the meta device, then fill each shard as if built whole.

A model built on the meta device costs no memory, but its values are gone: nothing was drawn
from the random generator. To give each rank exactly the slice that an unsharded build with
the same seed would hold, ``sharded_init`` records the CPU generator state at entry (rank 0's,
so all ranks agree, just as DDP starts every rank from rank 0's values) and which parameters
were built inside. After sharding, :class:`Replay` walks the model's modules in order; for
each module that owns parameters it builds that module's tensors - and only those, never the
whole model - in full on the CPU, runs its ``reset_parameters()`` from the recorded generator
state, and copies the local slice into the shard. Torch's layers initialise themselves in
``reset_parameters`` during construction in this same order, so the values match the
unsharded build exactly.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from scopedlite._private.torch_internals import cpu_twin

if TYPE_CHECKING:
    from scopedlite._strategies.fsdp.strategy import FSDPStrategy

__all__ = ["InitRecords", "Replay", "checkpoint_activations"]


@dataclass
class _Record:
    """One ``sharded_init`` block: where its random stream starts and where it has got to."""

    empty: bool
    rng: torch.Tensor  # the generator state replay continues from (rank 0's)
    local_expected: torch.Tensor | None  # this rank's state after the block, while untouched


class InitRecords:
    """The ``sharded_init`` blocks of one run and the parameters built in each."""

    def __init__(self) -> None:
        # id(parameter) -> (weak ref to it, its block); by identity: tensors compare by value
        self._owner: dict[int, tuple[weakref.ref[torch.Tensor], _Record]] = {}

    def owner(self, param: torch.Tensor) -> _Record | None:
        entry = self._owner.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def records(self) -> list[_Record]:
        return list({id(r): r for _, r in self._owner.values()}.values())

    @contextlib.contextmanager
    def context(self, strategy: FSDPStrategy, empty: bool) -> Iterator[None]:
        local = torch.get_rng_state()
        shared = strategy.broadcast(local, src=0).cpu()
        record = _Record(empty, shared.clone(), local if torch.equal(local, shared) else None)

        def registered(module: torch.nn.Module, name: str, tensor: Any) -> None:
            if tensor is not None:
                self._owner[id(tensor)] = (weakref.ref(tensor), record)

        hooks = torch.nn.modules.module
        handles = [
            hooks.register_module_parameter_registration_hook(registered),
            hooks.register_module_buffer_registration_hook(registered),
        ]
        try:
            with torch.device("meta"), strategy.placement.precision.init_dtype():
                yield
        finally:
            for handle in handles:
                handle.remove()

    def plan(self, module: torch.nn.Module) -> Replay:
        """Check now, before anything is sharded, that ``module`` can be materialised, and
        note which block built each submodule (sharding replaces the parameters)."""
        steps: list[tuple[torch.nn.Module, type[torch.nn.Module], _Record]] = []
        for sub in module.modules():
            own = [t for _, t in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)) if t.is_meta]
            if not own:
                continue
            records = {id(self.owner(p)) for p in own}
            record = self.owner(own[0])
            if record is None or len(records) != 1:
                raise ValueError(
                    f"{type(sub).__name__} has tensors on the meta device that were not built "
                    "inside lite.sharded_init(); build the model there: "
                    "`with lite.sharded_init(): model = Net()`."
                )
            if record.empty:
                continue
            if not callable(getattr(sub, "reset_parameters", None)):
                raise TypeError(
                    f"{type(sub).__name__} owns parameters or buffers but has no reset_parameters() method, "
                    "so its values cannot be recreated after a meta-device build. Give it "
                    "reset_parameters() (initialising its own parameters), or use "
                    "lite.sharded_init(empty=True) and load the weights from a checkpoint."
                )
            steps.append((sub, type(sub), record))  # fully_shard will change the class
        return Replay(self, steps)


class Replay:
    """Fill the shards of a module built in ``sharded_init`` (see the module docstring)."""

    def __init__(self, records: InitRecords, steps: list[tuple[torch.nn.Module, type[torch.nn.Module], _Record]]) -> None:
        self.records = records
        self.steps = steps

    def run(self) -> None:
        for sub, cls, record in self.steps:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(record.rng)
                twin = cpu_twin(sub, cls)
                twin.reset_parameters()
                record.rng = torch.get_rng_state()
            with torch.no_grad():
                full_params = dict(twin.named_parameters(recurse=False))
                full_buffers = dict(twin.named_buffers(recurse=False))
                for name, param in sub.named_parameters(recurse=False):
                    _copy_slice(param, full_params[name])
                for name, buffer in sub.named_buffers(recurse=False):
                    if name in full_buffers:
                        buffer.copy_(full_buffers[name])
        self._advance_global_rng()

    def _advance_global_rng(self) -> None:
        """Leave the generator where an unsharded build would have, if nothing drew from it
        since the block and all ranks started from the same state (a seeded run)."""
        for record in self.records.records():
            if record.local_expected is not None and torch.equal(torch.get_rng_state(), record.local_expected):
                torch.set_rng_state(record.rng)
                record.local_expected = record.rng.clone()


def _copy_slice(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import (  # lazy: ~0.7 s to import
        DTensor,
        distribute_tensor,
    )

    if isinstance(param, DTensor):
        # Every rank holds the full tensor: cut the local slice without communicating.
        local = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def checkpoint_activations(module: torch.nn.Module, classes: frozenset[type[torch.nn.Module]]) -> None:
    """Recompute the activations of submodules of ``classes`` in backward instead of storing them."""
    for sub in module.modules():
        if isinstance(sub, tuple(classes)):
            forward = sub.forward

            @functools.wraps(forward)
            def recomputed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            sub.forward = recomputed  # type: ignore[method-assign]
