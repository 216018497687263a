"""The distributed samplers ``setup_dataloader`` inserts, which read the scope they run in.

Every pass starts from one *order* of the whole data, the same on every rank:

- a plain ``RandomSampler`` (``shuffle=True``): ``torch.randperm(n)`` under a generator seeded
  with ``seed + epoch``, exactly as ``torch.utils.data.DistributedSampler`` draws it;
- a ``SequentialSampler`` (no shuffle): ``0 .. n-1``;
- a user's ``DistributedSampler``: the order it would draw itself (its own ``shuffle`` and
  ``seed``), so it is taken over rather than sharded a second time;
- any other sampler (``SubsetRandomSampler``, weighted, custom, a batch sampler): what it
  yields when drawn while torch's, Python's and numpy's global generators are seeded with
  ``seed + epoch``, so a sampler shuffling with any of them draws one order on all ranks.

Rank ``r`` of ``w`` then takes positions ``r, r + w, r + 2w, ...`` of that order. Outside
``lite.join`` the order is first padded by repeating its first items up to a multiple of
``w``, exactly as ``DistributedSampler(drop_last=False)`` does, because ranks that run out of
batches early would leave the others hanging in a collective. Inside ``lite.join`` nothing is
padded or dropped: each item is read once, the ranks may get different numbers, and each
rank's share is the padded share without its last, repeated item.

Whether a pass pads is decided once, when a set-up loader's pass begins
(:meth:`~scopedlite._api.loader_state.ResumeCursor.begin_pass` sets :attr:`padded` for the
pass); a sampler iterated or measured outside such a pass reads the scope then. The repeated
item of a padded pass, if this rank has one, is the last of its share (:meth:`repeats`), so
``lite.gather_for_metrics`` can leave it out (``_api/repeats.py``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sized

import torch
from torch.utils.data import (
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from scopedlite._api.interrupted import Interrupted
from scopedlite._api.seed import seeded_generators
from scopedlite._strategies.join.members import in_join

__all__ = ["ShardedBatchSampler", "ShardedSampler", "forward_epoch"]


def _length(sampler: Any, role: str) -> int:
    """``len(sampler)``, or a ``TypeError`` saying what to do: an order without a length
    would have to be drained to be padded and shared out, which never ends if it is endless."""
    try:
        return len(sampler)
    except TypeError as e:
        raise TypeError(
            f"{role}={type(sampler).__name__} has no __len__, so setup_dataloader cannot share "
            "its order out across ranks without reading all of it first (an endless one "
            "would never finish). Give it a __len__, or shard it yourself (yield only this "
            "rank's items, lite.current().data_parallel_rank of .data_parallel_size) and call "
            "setup_dataloader(loader, use_distributed_sampler=False)."
        ) from e


def _is_plain_random(sampler: Any) -> bool:
    """A ``RandomSampler`` as ``shuffle=True`` makes it: one permutation of the whole data
    from the global generator. Its order is replaced by ``DistributedSampler``'s; one with
    replacement, ``num_samples`` or its own generator is the user's choice and is kept."""
    return (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)  # the default: one whole permutation
        and sampler.generator is None
    )


def _check_takes_over(sampler: DistributedSampler, rank: int, world_size: int) -> None:  # type: ignore[type-arg]
    if (sampler.num_replicas, sampler.rank) != (world_size, rank):
        raise ValueError(
            f"The loader's DistributedSampler has num_replicas={sampler.num_replicas}, "
            f"rank={sampler.rank}, but this process is rank {rank} of {world_size}. Build it "
            "with the defaults inside lite.launch (DistributedSampler(dataset); under "
            "model_parallel with num_replicas=lite.current().data_parallel_size, "
            "rank=lite.current().data_parallel_rank), or pass the plain sampler and let "
            "setup_dataloader shard it."
        )


def _permutation(n: int, seed: int) -> list[int]:
    # exactly DistributedSampler.__iter__ with shuffle=True
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.randperm(n, generator=generator).tolist()


def _drawn(sampler: Any, seed: int) -> list[Any]:
    with seeded_generators(seed):
        return list(sampler)


def _order_rule(sampler: Any, rank: int, world_size: int, seed: int) -> tuple[int, Callable[[int], list[Any]], bool]:
    """How to draw ``sampler``'s order for an epoch: ``(length, epoch -> order, drop_last)``."""
    if isinstance(sampler, DistributedSampler):
        if type(sampler) is not DistributedSampler:
            raise TypeError(
                f"{type(sampler).__name__} is a DistributedSampler subclass: it already shards, "
                "and its order cannot be read without its own sharding. Keep it as it is "
                "(setup_dataloader does so for a loader), or pass the sampler it shards."
            )
        _check_takes_over(sampler, rank, world_size)
        n = len(sampler.dataset)  # type: ignore[arg-type]
        if sampler.shuffle:
            return n, lambda epoch: _permutation(n, sampler.seed + epoch), sampler.drop_last
        return n, lambda epoch: list(range(n)), sampler.drop_last
    n = _length(sampler, "sampler")
    if _is_plain_random(sampler):
        return n, lambda epoch: _permutation(n, seed + epoch), False
    if type(sampler) is SequentialSampler:
        return n, lambda epoch: list(range(n)), False
    return n, lambda epoch: _drawn(sampler, seed + epoch), False


def _share(order: list[Any], rank: int, world_size: int, pad: bool, drop_last: bool = False) -> list[Any]:
    """Rank ``rank``'s items of ``order``: strided, padded or cut as ``DistributedSampler``
    does outside join (``pad``), every item once inside it."""
    if pad and drop_last:
        order = order[: len(order) // world_size * world_size]
    elif pad and order:
        total = math.ceil(len(order) / world_size) * world_size
        order = (order * math.ceil(total / len(order)))[:total]
    return order[rank::world_size]


def _count(n: int, rank: int, world_size: int, pad: bool, drop_last: bool = False) -> int:
    if pad and drop_last:
        return n // world_size
    if pad:
        return math.ceil(n / world_size)
    return max(0, math.ceil((n - rank) / world_size))


def _repeats(n: int, rank: int, world_size: int, pad: bool, drop_last: bool = False) -> int:
    """The items padding added to rank ``rank``'s share, all at its end."""
    if not pad or drop_last:
        return 0
    return _count(n, rank, world_size, True) - _count(n, rank, world_size, False)


def _pads(sampler: ShardedSampler | ShardedBatchSampler) -> bool:
    """Whether ``sampler`` pads now: as its loader decided for the pass under way, else as
    the scope says (outside ``lite.join``)."""
    return sampler.padded if sampler.padded is not None else not in_join()


def forward_epoch(epoch: int, *targets: Any) -> None:
    """Call ``set_epoch`` on each distinct target that has one: a user's sampler that
    shuffles by epoch must see the epoch, or it repeats its order every pass."""
    seen: set[int] = set()
    for target in targets:
        set_epoch = getattr(target, "set_epoch", None)
        if target is None or id(target) in seen or not callable(set_epoch):
            continue
        seen.add(id(target))
        set_epoch(epoch)


class ShardedSampler(Sampler[int]):
    """This rank's share of ``sampler``'s order; padded outside ``lite.join``, exact inside.

    The order per epoch is ``DistributedSampler``'s for a plain ``RandomSampler``, a
    ``SequentialSampler`` or a ``DistributedSampler`` (which is taken over, never sharded
    twice), and what the sampler yields under seeded global generators otherwise (see the
    module docstring).

    Args:
        sampler: The sampler to shard. It must have ``__len__``.
        rank: This process's share: its global rank, or under ``model_parallel`` its
            data-parallel rank (``lite.current().data_parallel_rank`` is either).
        world_size: The number of shares (``lite.current().data_parallel_size``).
        seed: The seed every rank agrees on; the epoch is added to it per pass. A
            ``DistributedSampler`` keeps its own ``seed``.

    Raises:
        TypeError: ``sampler`` has no ``__len__``, or is a ``DistributedSampler`` subclass.
        ValueError: ``sampler`` is a ``DistributedSampler`` built for another rank or world.
    """

    def __init__(self, sampler: Sized, rank: int, world_size: int, seed: int = 0) -> None:
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        # set by the loader for one pass resumed at another world size (see loader_state)
        self.resumed: Interrupted | None = None
        # set by the loader for the pass under way: whether it pads (None: read the scope)
        self.padded: bool | None = None
        self._n, self._order, self._drop_last = _order_rule(sampler, rank, world_size, seed)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently in each epoch (identically on all ranks); passed on to the
        wrapped sampler if it has ``set_epoch`` too. Called by the script on a set-up
        loader's sampler (``loader.sampler.set_epoch(epoch)``), the epoch holds for every pass
        until the next call, as ``DistributedSampler``'s does."""
        self.epoch = epoch
        forward_epoch(epoch, self.sampler)

    def __iter__(self) -> Iterator[int]:
        order = self._order(self.epoch)
        if self.resumed is not None:
            order = [order[p] for p in self.resumed.remaining(len(order))]
        return iter(_share(order, self.rank, self.world_size, _pads(self), self._drop_last))

    def __len__(self) -> int:
        return _count(self._items(), self.rank, self.world_size, _pads(self), self._drop_last)

    def repeats(self) -> int:
        """How many items at the end of this rank's share repeat others (0 or 1): those a
        padded pass added to even out the ranks' counts."""
        return _repeats(self._items(), self.rank, self.world_size, _pads(self), self._drop_last)

    def _items(self) -> int:
        return len(self.resumed.remaining(self._n)) if self.resumed is not None else self._n


class ShardedBatchSampler(Sampler[list]):  # type: ignore[type-arg]
    """This rank's share of the batches of a user's batch sampler.

    Whole batches are dealt to ranks in turn (batch ``i`` to rank ``i % world_size``), so a
    batch sampler's own grouping (by length, by class, ...) is kept. The batches are drawn
    under global generators seeded with ``seed + epoch``, so every rank draws the same ones.
    Outside ``lite.join`` the list of batches is padded by repeating the first ones.

    Raises:
        TypeError: ``batch_sampler`` has no ``__len__``.
    """

    def __init__(self, batch_sampler: Sized, rank: int, world_size: int, seed: int = 0) -> None:
        self._n = _length(batch_sampler, "batch_sampler")
        self.batch_sampler = batch_sampler
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        self.resumed: Interrupted | None = None  # as for ShardedSampler
        self.padded: bool | None = None  # as for ShardedSampler
        self._lengths: list[int] = []  # the lengths of this rank's batches in its last pass

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently in each epoch; passed on to the batch sampler and to the
        sampler inside it, whichever have ``set_epoch``. Called by the script, the epoch
        holds for every pass until the next call, as for :class:`ShardedSampler`."""
        self.epoch = epoch
        forward_epoch(epoch, self.batch_sampler, getattr(self.batch_sampler, "sampler", None))

    def __iter__(self) -> Iterator[list]:  # type: ignore[type-arg]
        batches = _drawn(self.batch_sampler, self.seed + self.epoch)
        if self.resumed is not None:
            batches = [batches[p] for p in self.resumed.remaining(len(batches))]
        share = _share(batches, self.rank, self.world_size, pad=_pads(self))
        self._lengths = [len(batch) for batch in share]
        return iter(share)

    def __len__(self) -> int:
        return _count(self._items(), self.rank, self.world_size, pad=_pads(self))

    def repeats(self) -> int:
        """How many batches at the end of this rank's share repeat others (0 or 1)."""
        return _repeats(self._items(), self.rank, self.world_size, _pads(self))

    def last_length(self) -> int:
        """The number of items in the last batch of this rank's share (once iterated)."""
        return self._lengths[-1] if self._lengths else 0

    def share_rows(self) -> int:
        """The number of items in all of this rank's batches (once iterated)."""
        return sum(self._lengths)

    def _items(self) -> int:
        return len(self.resumed.remaining(self._n)) if self.resumed is not None else self._n
