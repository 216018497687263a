"""The distributed sampler ``setup_dataloader`` inserts, which reads the scope it runs in.

Outside ``lite.join`` it behaves like ``torch.utils.data.DistributedSampler``: indices are
padded (by repeating the first ones) so every rank gets the same number, because ranks that
run out of batches early would leave the others hanging in a collective. Inside ``lite.join``
it neither pads nor drops: rank ``r`` of ``w`` takes positions ``r, r + w, r + 2w, ...``, so
every sample is seen exactly once across ranks and the ranks may get different numbers of
batches, which join makes safe.

It shards the *user's* sampler (sequential, random, ``SubsetRandomSampler``, weighted, ...):
the wrapped sampler is iterated on every rank under the same torch seed (the
``seed_everything`` seed plus the epoch), so random samplers produce one order on all ranks
and each rank takes its share of it.
"""

from __future__ import annotations

import math
from typing import Iterator, Sized

import torch
from torch.utils.data import Sampler

from scopedlite._api.join import in_join

__all__ = ["ShardedBatchSampler", "ShardedSampler"]


def _materialise(sampler: Sized, seed: int, epoch: int) -> list:  # type: ignore[type-arg]
    # fork_rng keeps the user's global RNG stream untouched by our seeding.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + epoch)
        return list(sampler)  # type: ignore[call-overload]


def _shard(items: list, rank: int, world_size: int, pad: bool) -> list:  # type: ignore[type-arg]
    if pad and items:
        total = math.ceil(len(items) / world_size) * world_size
        repeats = math.ceil(total / len(items))
        items = (items * repeats)[:total]
    return items[rank::world_size]


def _count(n: int, rank: int, world_size: int, pad: bool) -> int:
    if pad:
        return math.ceil(n / world_size) if n else 0
    return max(0, math.ceil((n - rank) / world_size))


class ShardedSampler(Sampler[int]):
    """This rank's share of ``sampler``'s indices; padded outside ``lite.join``, exact inside.

    Args:
        sampler: The sampler to shard (anything with ``__iter__`` and ``__len__``).
        rank, world_size: This rank and the number of ranks.
        seed: Base seed for random samplers; the epoch is added to it.
    """

    def __init__(self, sampler: Sized, rank: int, world_size: int, seed: int = 0) -> None:
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently in each epoch (identically on all ranks)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        indices = _materialise(self.sampler, self.seed, self.epoch)
        return iter(_shard(indices, self.rank, self.world_size, pad=not in_join()))

    def __len__(self) -> int:
        return _count(len(self.sampler), self.rank, self.world_size, pad=not in_join())


class ShardedBatchSampler(Sampler[list]):  # type: ignore[type-arg]
    """This rank's share of the batches of a user's batch sampler.

    Whole batches are dealt to ranks in turn (batch ``i`` to rank ``i % world_size``), so a
    batch sampler's own grouping (by length, by class, ...) is kept. Outside ``lite.join``
    the list of batches is padded by repeating the first ones.
    """

    def __init__(self, batch_sampler: Sized, rank: int, world_size: int, seed: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        inner = getattr(self.batch_sampler, "set_epoch", None)
        if callable(inner):
            inner(epoch)

    def __iter__(self) -> Iterator[list]:  # type: ignore[type-arg]
        batches = _materialise(self.batch_sampler, self.seed, self.epoch)
        return iter(_shard(batches, self.rank, self.world_size, pad=not in_join()))

    def __len__(self) -> int:
        return _count(len(self.batch_sampler), self.rank, self.world_size, pad=not in_join())
