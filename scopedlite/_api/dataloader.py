"""``lite.setup_dataloader``: shard a loader across ranks and move its batches to the device.

The loader it returns only iterates. Which epoch a pass is belongs to its
:class:`~scopedlite._api.epochs.PassCount`, where it stands for a checkpoint to its
:class:`~scopedlite._api.loader_state.ResumeCursor`, and how batches reach the device to the
strategy when it has a way of its own (``SupportsDeviceFeed``), else to ``.to(device)``.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from scopedlite._api.collectives import broadcast
from scopedlite._api.current import current
from scopedlite._api.epochs import PassCount, book_of
from scopedlite._api.every_rank import every_rank_calls
from scopedlite._api.join import active_session
from scopedlite._api.loader_state import ResumeCursor
from scopedlite._api.rank_zero import in_rank_zero_first
from scopedlite._api.rebuild import refuse_unrebuildable, shard_loader
from scopedlite._api.seed import current_seed
from scopedlite._core.scope import carry
from scopedlite._core.structures import map_tensors
from scopedlite._strategies.abilities import SupportsDeviceFeed

__all__ = ["DeviceDataLoader", "setup_dataloader"]


class DeviceDataLoader:
    """A set-up loader: its batches arrive on the run's device, each pass with its epoch.

    Attribute access falls through to the wrapped ``DataLoader`` (``dataset``,
    ``batch_size``, ``sampler``, ...). ``len()`` is the pass's number of batches on this rank:
    inside ``lite.join`` the exact one, outside the padded one. Whether a pass pads is decided
    once, when it begins; between passes ``len()`` reads the scope it is called in. Its position, for
    ``lite.save``, is kept by its :class:`ResumeCursor` (``loader.cursor``).

    Args:
        loader: The loader to wrap (already sharded, where the run shards).
        device: Where batches are moved; ``None`` leaves them where they are.
        feed: The strategy's own way of bringing batches to the device (see
            ``SupportsDeviceFeed``), used instead of moving each batch with ``.to``.
        start: The epoch of the first pass (see ``epochs``).
    """

    def __init__(
        self,
        loader: DataLoader,  # type: ignore[type-arg]
        device: torch.device | None,
        feed: Callable[[Iterable[Any]], Iterator[Any]] | None = None,
        start: int = 0,
    ) -> None:
        self.loader = loader
        self.device = device
        self.feed = feed
        self._epochs = PassCount(loader, start, book_of(current()))
        self.cursor = ResumeCursor(loader, self._epochs)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass (it then advances by one per pass, as in HF
        Accelerate). ``loader.sampler.set_epoch(epoch)`` instead holds the epoch for every
        pass until the next call, as torch's ``DistributedSampler`` does."""
        self._epochs.choose_next(epoch)

    def __iter__(self) -> Iterator[Any]:
        # The pass's one question: is a lite.join block open? Inside, the pass pads nothing and
        # the session learns this rank's length (and, from _told, when the pass is over).
        session = active_session(current())
        loader = self.cursor.begin_pass(self._epochs.begin(), padded=session is None)
        if self.feed is not None:
            reads = _ReadAhead(self.cursor.batches(loader), self.loader.generator)
            yield from _past_first(self.cursor.counted(self.feed(reads), reads.generator_states), self._epochs.count)
            return
        batches = self.cursor.counted(_moved(self.cursor.batches(loader), self.device))
        cursor = None
        if session is not None:  # a one-process session has no cursor: nothing to tell
            cursor = session.loader_pass(len(loader) if loader is self.loader and _has_length(loader) else None)
        if cursor is not None:
            batches = _told(batches, cursor)
        yield from _past_first(batches, self._epochs.count)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_epochs", "cursor"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _moved(batches: Iterator[Any], device: torch.device | None) -> Iterator[Any]:
    """Each batch with its tensors (nested in lists, tuples, dicts) on ``device``."""
    if device is None:
        yield from batches
        return
    non_blocking = device.type == "cuda"
    for batch in batches:
        yield map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def _past_first(batches: Iterator[Any], count: Callable[[], None]) -> Iterator[Any]:
    """``batches``, calling ``count()`` when the second is asked for or the pass ends: a pass
    left after its first batch (a peek) is not counted (see ``PassCount.begin``)."""
    yield from itertools.islice(batches, 1)
    count()  # the loop asks for a second batch (or the pass had none): a peek never gets here
    yield from batches


def _told(batches: Iterator[Any], session: Any) -> Iterator[Any]:
    """``batches``, telling the join session when the next one is asked for and when the
    pass is over, at its end or where the loop left it (closing the iterator)."""
    try:
        for batch in batches:
            yield batch
            session.advance()
    except GeneratorExit:
        session.left_early()
        raise
    session.end()


def _has_length(loader: DataLoader) -> bool:  # type: ignore[type-arg]
    """Whether ``len(loader)`` is the number of batches a pass yields (not for an iterable dataset)."""
    if isinstance(loader.dataset, IterableDataset):
        return False
    try:
        len(loader)
    except TypeError:
        return False
    return True


class _ReadAhead:
    """A pass's batches for a strategy's feed, which may read them ahead of the loop, in a
    thread of its own (XLA's parallel loader reads up to 24 batches ahead in its thread).

    Each batch is read in the scopes open when the pass began: in the feed's thread no scope
    is open, and the sampler would see no run and no ``lite.join``. The iterator is made
    before, in the loop's thread, so a loader's workers start and draw their seed there.
    After each batch read, the state of the loader's generator is queued: reading ahead has
    drawn from it (a shuffle's next permutation), so a checkpoint taken in the middle of the
    pass records the state after the last batch handed out, not the reader's.
    """

    def __init__(self, batches: Iterator[Any], generator: torch.Generator | None) -> None:
        self.generator_states: collections.deque[torch.Tensor | None] = collections.deque()
        read = carry(next)  # the scopes of now: the generator below runs in the reader

        def each() -> Iterator[Any]:
            while True:
                try:
                    batch = read(batches)
                except StopIteration:
                    return
                self.generator_states.append(generator.get_state() if generator is not None else None)
                yield batch

        self._each = each()

    def __iter__(self) -> Iterator[Any]:
        return self._each


def _agreed(seed: int, starts: list[int]) -> tuple[int, list[int]]:
    """Rank 0's ``seed_everything`` seed and first epochs: ranks that seeded differently (say,
    per rank, for augmentation) must still draw one order, or samples are lost and others
    repeated. A call on some ranks only is refused before the broadcast (``every_rank.py``)."""
    if in_rank_zero_first():
        raise RuntimeError(
            "lite.setup_dataloader was called inside lite.rank_zero_first(): it agrees on the "
            "shuffle seed with the other ranks, which wait for this block to end, so the run "
            "would hang. Build the dataset inside the block and call setup_dataloader after it."
        )
    every_rank_calls(
        "lite.setup_dataloader",
        "the ranks agree on the shuffle seed, and each reads its own share of the dataset",
        "Set it up on every rank. A loader that one rank reads whole (an evaluation on rank 0 "
        "alone) needs no sharding: `lite.setup_dataloader(loader, use_distributed_sampler=False)`.",
    )
    seed, starts = broadcast((seed, starts), src=0)
    return int(seed), [int(start) for start in starts]


def setup_dataloader(
    *loaders: DataLoader,  # type: ignore[type-arg]
    use_distributed_sampler: bool = True,
    move_to_device: bool = True,
) -> Any:
    """Prepare loaders for the active run: shard them across ranks, move batches to the device.

    With more than one process the loader is rebuilt around :class:`ShardedSampler` (or
    :class:`ShardedBatchSampler` for a custom batch sampler): padded to even counts outside
    ``lite.join``, every sample once inside it. A plain shuffle or no shuffle reads exactly
    ``DistributedSampler``'s order, a user's ``DistributedSampler`` is taken over rather than
    sharded twice, and other samplers keep their own order, drawn under generators seeded
    alike on every rank. The shuffle seed is rank 0's ``seed_everything`` seed (0 if never
    called), agreed here once. Each loader counts its own passes: its n-th pass is epoch n,
    handed to every sampler with ``set_epoch``, as torch's recipe and Fabric do; a loader
    rebuilt over the same dataset continues the last one's count unless ``seed_everything``
    came in between; an epoch the script sets on one of the loader's samplers holds for every
    pass until it sets another, as in torch (see ``epochs``). Workers are seeded per (base seed, worker, rank). The
    shares go to the data-parallel ranks (``lite.current().data_parallel_rank`` of
    ``data_parallel_size``): one per process, except under ``model_parallel``, where the
    tensor-parallel ranks of one replica get the same batches (and the same worker seeds).
    The returned loader may be put in the state of ``lite.save``; after ``lite.load`` its next
    pass continues the saved epoch with the first batch not yet seen.

    Raises:
        TypeError: A loader is not a ``DataLoader``; or, when sharding, is a subclass, reads
            an ``IterableDataset``, or has a sampler or batch sampler without ``__len__``.
        ValueError: A ``DistributedSampler`` in the loader was built for another rank/world.

    Returns:
        One loader, or a tuple when several are given.
    """
    if not loaders:
        raise TypeError("setup_dataloader needs at least one DataLoader: `lite.setup_dataloader(loader)`.")
    run = current()
    shard = use_distributed_sampler and run.world_size > 1
    for loader in loaders:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"setup_dataloader takes torch DataLoaders, got {type(loader).__name__}.")
        if shard:
            refuse_unrebuildable(loader)
    book = book_of(run)
    seed, starts = current_seed(), [book.start(loader.dataset) for loader in loaders]
    if shard:
        seed, starts = _agreed(seed, starts)
    strategy = run.strategy
    feed = strategy.device_batches if move_to_device and isinstance(strategy, SupportsDeviceFeed) else None
    prepared = []
    for loader, start in zip(loaders, starts, strict=True):
        if shard:
            # over the data-parallel dimension: the tensor-parallel ranks of one replica
            # (model_parallel) read the same batches
            loader = shard_loader(loader, run.data_parallel_rank, run.data_parallel_size, seed)
        prepared.append(DeviceDataLoader(loader, run.device if move_to_device else None, feed, start))
    return prepared[0] if len(prepared) == 1 else tuple(prepared)
