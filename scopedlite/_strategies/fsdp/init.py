"""FSDP's ``sharded_init``: build on the meta device, then fill each shard as if built whole.

A model built on the meta device costs no memory, but its values are gone: nothing was drawn
from the random generator. ``sharded_init`` therefore records the build (``deferred/``): every
initialisation, in ``__init__`` (``reset_parameters()`` or not) and after it (Hugging Face's
``post_init()``), in the order it ran. When the block closes the random draws are replayed
once, in order, which leaves the generator where a plain build leaves it. At ``lite.setup``,
after sharding, :class:`Replay` computes each parameter's full value on its own - one
parameter at a time, never the whole model - exactly as an unsharded build with the same seed
(rank 0's) has it, and copies this rank's slice into the shard.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from scopedlite._core.dtensors import is_dtensor, shard_like
from scopedlite._strategies.deferred.build import DeferredBuild

if TYPE_CHECKING:
    from scopedlite._strategies.fsdp.strategy import FSDPStrategy

__all__ = ["InitRecords", "Replay", "checkpoint_activations"]


class InitRecords:
    """The ``sharded_init`` blocks of one run whose tensors are still referenced."""

    def __init__(self) -> None:
        self._builds: list[DeferredBuild] = []

    @contextlib.contextmanager
    def context(self, strategy: FSDPStrategy, empty: bool) -> Iterator[None]:
        self._builds = [b for b in self._builds if b.alive()]
        build = DeferredBuild(empty, agree=lambda obj: strategy.broadcast(obj, src=0))
        with strategy.placement.precision.init_dtype(), build.recording():
            yield
        self._builds.append(build)

    def owner(self, tensor: torch.Tensor) -> DeferredBuild | None:
        return next((b for b in self._builds if b.owns(tensor)), None)

    def plan(self, module: torch.nn.Module) -> Replay:
        """Check now, before anything is sharded, that every tensor of ``module`` can be given
        its value, and note where each comes from (sharding replaces the parameters)."""
        steps: list[tuple[torch.nn.Module, str, Any, torch.Tensor]] = []
        seen: set[int] = set()
        for sub in module.modules():
            for name, tensor in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)):
                if id(tensor) in seen:
                    continue  # tied: one tensor under two names
                seen.add(id(tensor))
                if not tensor.is_meta:  # made from data inside the block: its value is known
                    steps.append((sub, name, None, tensor.detach().clone()))
                    continue
                build = self.owner(tensor)
                if build is None:
                    raise ValueError(
                        f"{type(sub).__name__}.{name} is on the meta device but was not built inside "
                        "lite.sharded_init(), so its value is unknown; build the model there: "
                        "`with lite.sharded_init(): model = Net()`."
                    )
                steps.append((sub, name, build, tensor))
        return Replay(steps)


class Replay:
    """Fill the shards of a module built in ``sharded_init`` (see the module docstring)."""

    def __init__(self, steps: list[tuple[torch.nn.Module, str, Any, torch.Tensor]]) -> None:
        self.steps = steps

    def run(self) -> None:
        with torch.no_grad():
            for sub, name, build, tensor in self.steps:
                full = tensor if build is None else build.value(tensor)
                _copy_slice(getattr(sub, name), full)
        self.steps = []


def _copy_slice(param: torch.Tensor, full: torch.Tensor) -> None:
    if is_dtensor(param):
        # Every rank holds the full tensor: cut the local slice without communicating.
        param.to_local().copy_(shard_like(full, param).to_local())  # type: ignore[attr-defined]
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
