"""``lite.setup_dataloader``: shard a loader across ranks and move its batches to the device."""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
)

from scopedlite._api.collectives import broadcast
from scopedlite._api.current import current
from scopedlite._api.join import in_join
from scopedlite._api.loader_state import (
    FORMAT,
    Interrupted,
    Pending,
    loader_arguments,
    resumed_loader,
    spare_generator,
)
from scopedlite._api.rank_zero import in_rank_zero_first
from scopedlite._api.sampler import ShardedBatchSampler, ShardedSampler, forward_epoch
from scopedlite._api.seed import SeedWorker, current_seed
from scopedlite._core import rng
from scopedlite._core.run import Run
from scopedlite._core.structures import map_tensors
from scopedlite._strategies.abilities import SupportsDeviceFeed

__all__ = ["DeviceDataLoader", "setup_dataloader"]

class _PassBook:
    """The epoch the next loader of a run starts at: one more than the last epoch any of the
    run's loaders has begun.

    A loader counts its own passes from there. Loaders built once (train and validation side
    by side) count 0, 1, 2, ... as Lightning Fabric's do, and a loader rebuilt every epoch
    (k-fold) continues the count instead of starting at 0 again, which would repeat the same
    order every epoch. The count follows only the program's own calls, so every rank agrees.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.next_epoch = 0

    def began(self, epoch: int) -> None:
        self.next_epoch = max(self.next_epoch, epoch + 1)


_books: contextvars.ContextVar[_PassBook | None] = contextvars.ContextVar("scopedlite.passes", default=None)


def _book_of(run: Run) -> _PassBook:
    book = _books.get()
    if book is None or book.run is not run:
        book = _PassBook(run)
        _books.set(book)
    return book


class DeviceDataLoader:
    """A loader whose batches arrive on the run's device, with the epoch advanced per pass.

    Attribute access falls through to the wrapped ``DataLoader`` (``dataset``,
    ``batch_size``, ``sampler``, ...). ``len()`` reads the scope: inside ``lite.join`` it is
    this rank's exact number of batches, outside the padded one.

    Args:
        loader: The loader to wrap.
        device: Where batches are moved; ``None`` leaves them where they are.
        passes: The run's pass count (see :class:`_PassBook`); the active run's by default.
    """

    def __init__(
        self,
        loader: DataLoader,  # type: ignore[type-arg]
        device: torch.device | None,
        feed: Callable[[Iterable[Any]], Iterator[Any]] | None = None,
        passes: _PassBook | None = None,
    ) -> None:
        self.loader = loader
        self.device = device
        self.feed = feed  # the strategy's own way to the device (XLA's MpDeviceLoader)
        self._passes = passes if passes is not None else _book_of(current())
        self._epoch = self._passes.next_epoch
        self._holders = _epoch_holders(loader)
        self._seen = _epochs_of(self._holders)
        # the current pass, for a checkpoint taken in the middle of it (see loader_state)
        self._in_pass = False
        self._pass_epoch = self._epoch
        self._position = 0  # batches of this pass handed out (skipped ones of a resume included)
        self._pass_rng: dict[str, Any] | None = None
        self._pass_padded = False
        self._pass_share = 0  # this rank's count of sampler items in the pass
        self._pending: Pending | None = None
        self._pending_entry: dict[str, Any] | None = None  # the checkpoint entry _pending came from
        # persistent workers draw their base seed once per process, when started: whether this
        # process started them, and whether the run (before a restart) had
        self._iterated_here = False
        self._iterated_before = False
        self._pass_drew_seed = True
        self._pass_reshard: tuple[int, Interrupted | None] | None = None  # (seed, resumed) of a resharded pass

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass (it then advances by one per pass)."""
        self._epoch = epoch

    def _start_pass(self) -> int:
        """Hand this pass's epoch to every sampler of the loader that takes one."""
        epoch = self._epoch_set_by_user()
        if epoch is None:
            epoch = self._epoch
        forward_epoch(epoch, *self._holders)
        self._seen = _epochs_of(self._holders)
        self._epoch = epoch + 1
        self._passes.began(epoch)
        return epoch

    def _epoch_set_by_user(self) -> int | None:
        """An epoch set on one of the loader's samplers since the last pass, if any.

        A script ported from torchrun or Fabric calls ``sampler.set_epoch(epoch)`` itself (on
        its own ``DistributedSampler``, or on ``loader.sampler``), possibly from a resumed
        epoch. That value wins over our count, as it would without scopedlite.
        """
        for holder in self._holders:
            epoch = getattr(holder, "epoch", None)
            if isinstance(epoch, int) and epoch != self._seen.get(id(holder)):
                return epoch
        return None

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending, self._pending_entry = self._pending, None, None
        epoch = self._start_pass()
        if pending is not None and pending.epoch != epoch:
            pending = None  # the script chose another epoch itself: a fresh pass of it
        loader = self._begin_pass(epoch, pending)
        if self.feed is not None:
            for batch in self.feed(loader):
                self._position += 1
                yield batch
            self._in_pass = False
            return
        device = self.device
        non_blocking = device is not None and device.type == "cuda"
        for batch in self._iterate(loader):
            if device is not None:
                batch = map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))
            self._position += 1
            yield batch
        self._in_pass = False

    def _iterate(self, loader: DataLoader) -> Iterator[Any]:  # type: ignore[type-arg]
        """``iter(loader)``; persistent workers that the run had started before a restart are
        started again without drawing a base seed the uninterrupted run did not draw, which
        would shift the random stream (dropout, a shuffle from torch's generator) by one."""
        if loader is self.loader and not self._pass_drew_seed and not self._iterated_here:
            own, loader.generator = loader.generator, spare_generator()
            try:
                iterator = iter(loader)
            finally:
                loader.generator = own
        else:
            iterator = iter(loader)
        if loader is self.loader:
            self._iterated_here = True
        return iterator

    def _begin_pass(self, epoch: int, pending: Pending | None) -> DataLoader:  # type: ignore[type-arg]
        """Record where this pass starts; for a resumed pass, set the samplers and random
        states up and return the one-pass loader that continues it."""
        for sampler in self._sharded_samplers():
            sampler.resumed = pending.resumed if pending is not None else None
        generator = self.loader.generator
        if pending is not None and pending.pass_rng is not None:
            rng.restore(pending.pass_rng, generator)
        self._pass_rng = rng.capture(generator)
        self._pass_epoch = epoch
        self._pass_padded = not in_join()
        self._pass_share = _items(self.loader)
        self._pass_drew_seed = not (self.loader.persistent_workers and (self._iterated_here or self._iterated_before))
        self._pass_reshard = None
        self._in_pass = True
        if pending is None:
            self._position = 0
            return self.loader
        self._position = pending.skip
        self._pass_drew_seed = pending.drew_seed
        loader = self.loader
        if pending.reshard_seed is not None:  # one process finishing a pass begun by several
            loader = _shard_loader(self.loader, 0, 1, pending.reshard_seed)
            holders = _epoch_holders(loader)
            forward_epoch(epoch, *holders)
            for holder in holders:
                if isinstance(holder, (ShardedSampler, ShardedBatchSampler)):
                    holder.resumed = pending.resumed
            self._pass_share = _items(loader)
            self._pass_reshard = (pending.reshard_seed, pending.resumed)
        return resumed_loader(loader, pending)

    def _sharded_samplers(self) -> list[Any]:
        return [h for h in self._holders if isinstance(h, (ShardedSampler, ShardedBatchSampler))]

    def _units_per_batch(self) -> int:
        """Sampler items per batch: the batch size when our sampler sits in a ``BatchSampler``,
        1 when it yields whole batches itself or the loader has no batching."""
        batch_sampler = self.loader.batch_sampler
        if batch_sampler is None or isinstance(batch_sampler, ShardedBatchSampler):
            return 1
        return int(batch_sampler.batch_size)

    def _lite_unstarted_entry(self) -> dict[str, Any] | None:
        """The loaded checkpoint entry, while the pass it resumes has not begun: saved again
        as it is, so a run stopped again before its first batch loses nothing."""
        return self._pending_entry

    def _lite_local_state(self) -> dict[str, Any]:
        """This rank's part of the loader's checkpoint entry (see ``lite.save``)."""
        if self._in_pass and self._position > 0:
            _refuse_mid_pass(self.loader)
        samplers = self._sharded_samplers()
        resumed = samplers[0].resumed if samplers else None
        reshard_seed = None
        if self._in_pass and self._pass_reshard is not None:
            reshard_seed, resumed = self._pass_reshard
        return {
            "in_pass": self._in_pass,
            "epoch": self._pass_epoch if self._in_pass else self._epoch,
            "position": self._position,
            "taken": min(self._position * self._units_per_batch(), self._pass_share),
            "padded": self._pass_padded,
            "drop_last": bool(getattr(samplers[0], "_drop_last", False)) if samplers else False,
            "sharded": bool(samplers) or reshard_seed is not None,
            "seed": samplers[0].seed if samplers else reshard_seed,
            "reshard_seed": reshard_seed,
            "resumed": resumed.to_state() if resumed is not None else None,
            "pass_rng": self._pass_rng,
            "rng": rng.capture(self.loader.generator),
            "drew_seed": self._pass_drew_seed,
            "iterated": self._iterated_here or self._iterated_before,
        }

    def _lite_load_state(self, saved: Any, rank: int, world_size: int) -> None:
        """Continue from a checkpoint entry written by ``lite.save`` (every rank's state)."""
        if not (isinstance(saved, dict) and saved.get("format") == FORMAT):
            raise ValueError(
                "The checkpoint entry for this loader is not a loader state written by "
                "lite.save (a loader from lite.setup_dataloader saved under the same key)."
            )
        ranks: list[dict[str, Any]] = saved["ranks"]
        mine = ranks[rank] if rank < len(ranks) else None
        self._seen = _epochs_of(self._holders)
        self._iterated_before = bool(ranks[0]["iterated"])
        if not any(r["in_pass"] for r in ranks):  # saved between passes
            self._epoch = int(ranks[0]["epoch"])
            if self._epoch > 0:
                self._passes.began(self._epoch - 1)
            if mine is not None:
                rng.restore(mine["rng"], self.loader.generator)
            return
        epoch = int(next(r["epoch"] for r in ranks if r["in_pass"]))
        before = Interrupted.from_state(ranks[0]["resumed"])
        if len(ranks) == world_size and mine is not None:
            reshard = mine.get("reshard_seed")
            pending = Pending(
                epoch, int(mine["position"]), mine["pass_rng"], mine["rng"], before, bool(mine["drew_seed"]), reshard
            )
        else:
            sharded_here = bool(self._sharded_samplers())
            if not (all(r["sharded"] for r in ranks) and (sharded_here or world_size == 1)):
                raise ValueError(
                    f"This loader was saved in the middle of epoch {epoch} by a run of "
                    f"{len(ranks)} process(es) and is loaded by one of {world_size}: the rest of "
                    "a pass can be dealt out to another number of ranks only when the saving run "
                    "sharded the loader (2 or more processes, use_distributed_sampler=True) and "
                    "the loading one shards it too or is one process. Resume with the same "
                    "number of processes, or save at the end of an epoch."
                )
            taken = tuple(int(r["taken"]) for r in ranks)
            interrupted = Interrupted(len(ranks), taken, bool(ranks[0]["padded"]), bool(ranks[0]["drop_last"]), before)
            reshard = None if sharded_here else int(ranks[0]["seed"])
            pending = Pending(epoch, 0, None, mine["rng"] if mine is not None else None, interrupted, True, reshard)
        self._pending = pending
        self._pending_entry = saved
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_passes", "_holders", "_seen"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _epoch_holders(loader: DataLoader) -> list[Any]:  # type: ignore[type-arg]
    """Each distinct sampler of ``loader`` with ``set_epoch``: the sampler, the batch sampler,
    and the user's samplers that ours wrap, so that the epoch reaches all of them."""
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    inner_batch_sampler = getattr(batch_sampler, "batch_sampler", None)
    candidates = (
        sampler,
        getattr(sampler, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        inner_batch_sampler,
        getattr(inner_batch_sampler, "sampler", None),
    )
    holders: list[Any] = []
    for candidate in candidates:
        if callable(getattr(candidate, "set_epoch", None)) and all(candidate is not h for h in holders):
            holders.append(candidate)
    return holders


def _items(loader: DataLoader) -> int:  # type: ignore[type-arg]
    """How many items this rank's sampler of ``loader`` hands out in a pass (0 if unknown)."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None or isinstance(batch_sampler, ShardedBatchSampler):
        sampler: Any = batch_sampler if batch_sampler is not None else loader.sampler
    else:
        sampler = getattr(batch_sampler, "sampler", None)
    try:
        return len(sampler)
    except TypeError:
        return 0


def _refuse_mid_pass(loader: DataLoader) -> None:  # type: ignore[type-arg]
    """A position inside a pass is resumed by re-creating the loader for that pass: refused
    at the save for loaders that cannot be re-created, rather than at the restart."""
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "lite.save cannot record a position inside a pass of a loader over an "
            "IterableDataset: it has no indices to skip. Save between passes, or keep the "
            "stream's position in your dataset and save that instead of the loader."
        )
    if type(loader) is not DataLoader:
        raise TypeError(
            f"lite.save cannot record a position inside a pass of a {type(loader).__name__} "
            "(a DataLoader subclass): the rest of the pass is read by a re-created "
            "DataLoader. Pass a plain torch.utils.data.DataLoader to setup_dataloader, or "
            "save between passes."
        )


def _epochs_of(holders: list[Any]) -> dict[int, Any]:
    return {id(holder): getattr(holder, "epoch", None) for holder in holders}


def _refuse_unrebuildable(loader: DataLoader) -> None:  # type: ignore[type-arg]
    if type(loader) is not DataLoader:
        raise TypeError(
            f"setup_dataloader rebuilds the loader around a distributed sampler and cannot "
            f"rebuild a {type(loader).__name__} (a DataLoader subclass) faithfully. Pass a "
            "plain torch.utils.data.DataLoader, or shard it yourself (e.g. with "
            "lite.ShardedSampler(sampler, run.data_parallel_rank, run.data_parallel_size)) and call "
            "setup_dataloader(loader, use_distributed_sampler=False)."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "setup_dataloader cannot shard an IterableDataset: it has no indices to deal out, "
            "so every rank would read the whole stream. Make the dataset yield this rank's "
            "share itself (lite.current().data_parallel_rank of .data_parallel_size), then call "
            "setup_dataloader(loader, use_distributed_sampler=False)."
        )


def _already_sharded(sampler: Any) -> bool:
    """A ``DistributedSampler`` subclass shards by itself in a way we cannot read: kept as it
    is. (A plain ``DistributedSampler`` is taken over by :class:`ShardedSampler` instead.)"""
    return isinstance(sampler, DistributedSampler) and type(sampler) is not DistributedSampler


def _carried(loader: DataLoader, rank: int) -> dict[str, Any]:  # type: ignore[type-arg]
    """The loader's own arguments, with workers seeded per rank (see :class:`SeedWorker`)."""
    kwargs = loader_arguments(loader)
    if loader.num_workers > 0:
        kwargs["worker_init_fn"] = SeedWorker(rank, loader.worker_init_fn)
    return kwargs


def _shard_loader(loader: DataLoader, rank: int, world_size: int, seed: int) -> DataLoader:  # type: ignore[type-arg]
    kwargs = _carried(loader, rank)
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the loader yields single samples
        sampler = loader.sampler
        if not _already_sharded(sampler):
            sampler = ShardedSampler(sampler, rank, world_size, seed)  # type: ignore[arg-type]
        return DataLoader(loader.dataset, batch_size=None, sampler=sampler, **kwargs)
    inner = getattr(batch_sampler, "sampler", None)
    if type(batch_sampler) is BatchSampler:
        if not _already_sharded(inner):
            inner = ShardedSampler(inner, rank, world_size, seed)  # type: ignore[arg-type]
        return DataLoader(
            loader.dataset,
            batch_size=batch_sampler.batch_size,
            drop_last=batch_sampler.drop_last,
            sampler=inner,
            **kwargs,
        )
    if not isinstance(inner, DistributedSampler):
        batch_sampler = ShardedBatchSampler(batch_sampler, rank, world_size, seed)  # type: ignore[arg-type]
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


def _agreed_seed() -> int:
    """Rank 0's ``seed_everything`` seed: ranks that seeded differently (say, per rank, for
    augmentation) must still draw one order, or samples are lost and others repeated."""
    if in_rank_zero_first():
        raise RuntimeError(
            "lite.setup_dataloader was called inside lite.rank_zero_first(): it agrees on the "
            "shuffle seed with the other ranks, which wait for this block to end, so the run "
            "would hang. Build the dataset inside the block and call setup_dataloader after it."
        )
    return int(broadcast(current_seed(), src=0))


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
    called), agreed here once. The epoch advances each pass and continues across loaders
    rebuilt every epoch. Workers are seeded per (base seed, worker, rank). The shares go to
    the data-parallel ranks (``lite.current().data_parallel_rank`` of ``data_parallel_size``):
    one per process, except under ``model_parallel``, where the tensor-parallel ranks of one
    replica get the same batches (and the same worker seeds). The returned loader
    may be put in the state of ``lite.save``; after ``lite.load`` its next pass continues the
    saved epoch with the first batch not yet seen.

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
            _refuse_unrebuildable(loader)
    seed = _agreed_seed() if shard else current_seed()
    prepared = []
    for loader in loaders:
        if shard:
            # over the data-parallel dimension: the tensor-parallel ranks of one replica
            # (model_parallel) read the same batches
            loader = _shard_loader(loader, run.data_parallel_rank, run.data_parallel_size, seed)
        strategy = run.strategy
        feed = strategy.device_batches if move_to_device and isinstance(strategy, SupportsDeviceFeed) else None
        prepared.append(DeviceDataLoader(loader, run.device if move_to_device else None, feed))
    return prepared[0] if len(prepared) == 1 else tuple(prepared)
