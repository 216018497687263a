"""The optional abilities of a strategy, each a declared protocol.

The front end asks ``isinstance(strategy, SupportsX)`` and never looks for a concrete class
or probes attributes with ``getattr``: a new strategy gains an ability by defining its
methods, and nothing else changes.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, ContextManager, Iterable, Iterator, Protocol, runtime_checkable

import torch

__all__ = [
    "SupportsBackgroundCheckpoint",
    "SupportsCheckpoint",
    "SupportsDeviceFeed",
    "SupportsJoin",
    "SupportsJointSetup",
    "SupportsModelBackward",
    "SupportsNativeLoad",
    "SupportsNoBackwardSync",
]


@runtime_checkable
class SupportsNoBackwardSync(Protocol):
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        """Skip gradient synchronisation of ``module`` inside the returned context."""
        ...


@runtime_checkable
class SupportsJoin(Protocol):
    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Any:
        """Return a join session (a context manager, see ``join/session.py``) for uneven inputs."""
        ...


@runtime_checkable
class SupportsJointSetup(Protocol):
    def setup_module_and_optimizers(
        self, module: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """Set up a model together with its optimizers, for backends that build one object
        from both (a DeepSpeed engine). ``lite.setup(model, opt)`` prefers this when present."""
        ...


@runtime_checkable
class SupportsModelBackward(Protocol):
    def backward_model(self, loss: torch.Tensor, model: torch.nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward through ``model`` (None: the strategy finds the model that produced
        ``loss``), for backends where each model runs its own backward (DeepSpeed engines).
        ``lite.backward(loss, model=model)`` prefers this when present."""
        ...


@runtime_checkable
class SupportsCheckpoint(Protocol):
    """A strategy that writes a checkpoint format of its own (a folder of shards, an engine
    directory): ``lite.save`` hands it the whole state instead of writing one file. Every
    strategy reads every format (``Strategy.load_module_from`` and ``load_optimizer_from``)."""

    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None: ...


@runtime_checkable
class SupportsBackgroundCheckpoint(Protocol):
    """A strategy with a checkpoint format of its own (:class:`SupportsCheckpoint`) that can
    also write it in the background, for ``lite.save(path, state, blocking=False)``. (A
    strategy that writes the common file needs nothing: the front end copies and writes it.)"""

    def start_checkpoint(
        self, path: str | os.PathLike[str], state: dict[str, Any], staging: Any
    ) -> Callable[[threading.Event], None] | None:
        """Do now, on every rank, what must happen in step with the other ranks (collectives,
        the copy of this rank's tensors through ``staging``, an ``_io.background.Staging``),
        and return what is left for this rank's background thread (None: nothing). That
        work gets an event set when it is to stop, and must leave the previous checkpoint
        at ``path`` unless it completes."""
        ...


@runtime_checkable
class SupportsNativeLoad(Protocol):
    def load_native(self, checkpoint: Any, state: dict[str, Any], strict: bool) -> list[str]:
        """Load entries of ``state`` from ``checkpoint`` (an ``_io.canonical.Checkpoint``) the
        backend's own way where it is in the backend's own format and layout (DeepSpeed's
        engine at the same world size and stage); return their keys. The other entries are
        loaded the common way."""
        ...


@runtime_checkable
class SupportsDeviceFeed(Protocol):
    def device_batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield one pass of a set-up loader's batches on the device the strategy's own way
        (XLA's parallel loader), instead of the front end moving each with ``.to(device)``.

        Called by ``lite.setup_dataloader``'s loader once per pass, with the pass as the
        front end prepared it (this rank's shard, the epoch's order, a resumed pass's rest):
        yield every batch once and in order, and release what was started when the pass ends
        or is left early. ``batches`` may be read from another thread; each batch is then
        still read in the scopes of the pass.
        """
        ...
