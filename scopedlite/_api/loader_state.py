"""Where a loader of ``setup_dataloader`` stands, as checkpoint data, and how it resumes.

A pass that a preemption interrupted resumes in one of two ways:

- **Same world size**: every rank draws exactly the batches it would have drawn, so the run
  continues bit for bit. The pass is started again under the random states it started with
  (its order and the workers' base seed are drawn from them), the batches this rank already
  took are skipped by index, without loading them, and then the random states of the moment
  of the save are put back, just before the first batch not yet seen is loaded.
- **Another world size**: the positions of the pass's order that no rank of the saving run
  took are dealt out to the new ranks (see :class:`Interrupted`), so the epoch finishes with
  every sample read once (inside ``lite.join``; outside, padded as at the start of any pass).

Everything saved is tensors, numbers, strings and lists, so ``weights_only=True`` reads it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from scopedlite._core import rng

__all__ = ["FORMAT", "Interrupted", "Pending", "loader_arguments", "resumed_loader", "spare_generator"]

FORMAT = "scopedlite.loader/1"


@dataclass(frozen=True)
class Interrupted:
    """The part of a pass's order that the ranks of a run of another size had taken.

    Old rank ``r`` of ``world_size`` read positions ``r, r + w, r + 2w, ...`` of the pass's
    order, padded (outside ``lite.join``) or not, and had taken the first ``taken[r]`` of
    them. ``before`` is the same record for a pass that was itself a resumed one, whose order
    was already the remainder of an earlier run's.
    """

    world_size: int
    taken: tuple[int, ...]
    padded: bool
    drop_last: bool
    before: Interrupted | None = None

    def remaining(self, n: int) -> list[int]:
        """The positions (of an order of ``n`` items) that no old rank took, in order."""
        base = self.before.remaining(n) if self.before is not None else list(range(n))
        m, w = len(base), self.world_size
        if self.padded and self.drop_last:
            limit = total = m // w * w
        elif self.padded:
            limit, total = m, math.ceil(m / w) * w
        else:
            limit = total = m
        taken: set[int] = set()
        for rank, count in enumerate(self.taken):
            for position in range(rank, total, w)[:count]:
                taken.add(position % m)
        return [base[p] for p in range(limit) if p not in taken]

    def to_state(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "taken": list(self.taken),
            "padded": self.padded,
            "drop_last": self.drop_last,
            "before": self.before.to_state() if self.before is not None else None,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Interrupted | None:
        if state is None:
            return None
        return cls(
            int(state["world_size"]),
            tuple(int(t) for t in state["taken"]),
            bool(state["padded"]),
            bool(state["drop_last"]),
            cls.from_state(state["before"]),
        )


@dataclass(frozen=True)
class Pending:
    """A loaded pass that the loader's next pass continues.

    Attributes:
        epoch: The epoch of the interrupted pass.
        skip: Batches of this rank's share to skip (same world size), else 0.
        pass_rng: The random states the pass started under, or None across a resize.
        rng: The random states at the save, put back before the first batch not yet seen
            (None on a rank the saving run did not have).
        resumed: What the sharded sampler's order is reduced to for this pass.
        drew_seed: Whether the interrupted pass drew its workers' base seed from the loader's
            generator (or torch's): not when its persistent workers were already running.
        reshard_seed: Set when a single process continues a pass that several processes
            began: its loader is not sharded, so the pass is read through a sharded copy (one
            rank of one) drawing the order with the seed the saving run shuffled with.
    """

    epoch: int
    skip: int
    pass_rng: dict[str, Any] | None
    rng: dict[str, Any] | None
    resumed: Interrupted | None
    drew_seed: bool = True
    reshard_seed: int | None = None


class _SkipThenRestore(Sampler[Any]):
    """The index sampler of a resumed pass: skips what was taken, then restores the random
    states of the save, in the main process, right before the next batch is fetched."""

    def __init__(self, inner: Any, skip: int, state: dict[str, Any] | None, generator: torch.Generator | None) -> None:
        self.inner = inner
        self.skip = skip
        self.state = state
        self.generator = generator

    def __iter__(self) -> Iterator[Any]:
        indices = iter(self.inner)
        for _ in itertools.islice(indices, self.skip):
            pass
        if self.state is not None:
            rng.restore(self.state, self.generator)
        yield from indices

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


# DataLoader arguments carried over when a loader is rebuilt (around our sampler at setup,
# around a resumed pass here).
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def loader_arguments(loader: DataLoader) -> dict[str, Any]:  # type: ignore[type-arg]
    """The arguments ``loader`` was built with that a rebuilt copy of it keeps."""
    kwargs = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def spare_generator() -> torch.Generator:
    """A generator for a ``DataLoader`` to draw its workers' base seed from, instead of the
    user's or torch's, where the uninterrupted run drew none: a loader with persistent workers
    draws it only when it starts them, once per process."""
    return torch.Generator().manual_seed(0)


def resumed_loader(loader: DataLoader, pending: Pending) -> DataLoader:  # type: ignore[type-arg]
    """A copy of ``loader`` for the one resumed pass: same dataset, workers and collation,
    its index sampler wrapped in :class:`_SkipThenRestore`."""
    kwargs = loader_arguments(loader)  # its worker_init_fn is already ours
    if not pending.drew_seed:
        kwargs["generator"] = spare_generator()
    if loader.batch_sampler is not None:
        batches = _SkipThenRestore(loader.batch_sampler, pending.skip, pending.rng, loader.generator)
        return DataLoader(loader.dataset, batch_sampler=batches, **kwargs)
    samples = _SkipThenRestore(loader.sampler, pending.skip, pending.rng, loader.generator)
    return DataLoader(loader.dataset, batch_size=None, sampler=samples, **kwargs)
