"""Where a loader of ``setup_dataloader`` stands, as checkpoint data, and how it resumes.

Each set-up loader has a :class:`ResumeCursor`: it follows the loader's passes (which epoch,
how many batches handed out, the random states the pass began under) and turns that into a
checkpoint entry with :meth:`~ResumeCursor.state` and back with :meth:`~ResumeCursor.load`,
which ``lite.save`` and ``lite.load`` call.

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

import collections
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from scopedlite._api.collectives import broadcast
from scopedlite._api.current import current
from scopedlite._api.epochs import PassCount, epoch_holders, hand_epoch
from scopedlite._api.interrupted import Interrupted
from scopedlite._api.rebuild import loader_arguments, shard_loader
from scopedlite._api.repeats import PassRepeats, note
from scopedlite._api.sampler import ShardedBatchSampler, ShardedSampler
from scopedlite._core import rng
from scopedlite._core.structures import map_tensors

__all__ = ["FORMAT", "Interrupted", "Pending", "ResumeCursor", "resumed_loader", "spare_generator"]

FORMAT = "scopedlite.loader/1"


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


class ResumeCursor:
    """A set-up loader's position, as a checkpoint entry and back.

    The loader tells it when a pass begins (:meth:`begin_pass`) and hands its batches
    through :meth:`counted`; ``lite.save`` takes :meth:`state` and ``lite.load`` gives it
    back to :meth:`load`, after which the loader's next pass continues the saved one.

    Args:
        loader: The set-up (sharded) ``DataLoader``.
        epochs: The loader's pass count, which a loaded entry moves on.
    """

    def __init__(self, loader: DataLoader, epochs: PassCount) -> None:  # type: ignore[type-arg]
        self.loader = loader
        self.epochs = epochs
        self._in_pass = False
        self._pass_epoch = epochs.next
        self._position = 0  # batches of this pass handed out (skipped ones of a resume included)
        self._pass_rng: dict[str, Any] | None = None
        self._pass_padded = False
        self._repeats: PassRepeats | None = None  # where this rank's share of a padded pass repeats
        self._passes = 0  # passes begun
        self._pass_share = 0  # this rank's count of sampler items in the pass
        self._pending: Pending | None = None
        self._pending_entry: dict[str, Any] | None = None  # the checkpoint entry _pending came from
        # persistent workers draw their base seed once per process, when started: whether this
        # process started them, and whether the run (before a restart) had
        self._iterated_here = False
        self._iterated_before = False
        self._pass_drew_seed = True
        self._pass_reshard: tuple[int, Interrupted | None] | None = None  # (seed, resumed) of a resharded pass
        self._fed_generator: torch.Tensor | None = None  # see counted()

    # -- following the passes --------------------------------------------------------------

    def begin_pass(self, epoch: int, padded: bool) -> DataLoader:  # type: ignore[type-arg]
        """Record where a pass of ``epoch`` starts and return the loader that reads it: the
        set-up loader, or for a loaded pass, the one-pass loader that continues it. ``padded``:
        whether the pass pads (outside ``lite.join``), decided once for it and told to the
        samplers."""
        pending, self._pending, self._pending_entry = self._pending, None, None
        if pending is not None and pending.epoch != epoch:
            pending = None  # the script chose another epoch itself: a fresh pass of it
        for sampler in self._sharded_samplers():
            sampler.resumed = pending.resumed if pending is not None else None
            sampler.padded = padded
        generator = self.loader.generator
        if pending is not None and pending.pass_rng is not None:
            rng.restore(pending.pass_rng, generator)
        self._pass_rng = rng.capture(generator)
        self._pass_epoch = epoch
        self._pass_padded = padded
        self._passes += 1
        self._pass_share = _items(self.loader)
        self._repeats = self._where_repeats() if padded else None
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
            loader = shard_loader(self.loader, 0, 1, pending.reshard_seed)
            holders = epoch_holders(loader)
            hand_epoch(epoch, holders)
            for holder in holders:
                if isinstance(holder, (ShardedSampler, ShardedBatchSampler)):
                    holder.resumed = pending.resumed
            self._pass_share = _items(loader)
            self._pass_reshard = (pending.reshard_seed, pending.resumed)
        return resumed_loader(loader, pending)

    def batches(self, loader: DataLoader) -> Iterator[Any]:  # type: ignore[type-arg]
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

    def counted(
        self, batches: Iterable[Any], generator_states: collections.deque[torch.Tensor | None] | None = None
    ) -> Iterator[Any]:
        """Hand out ``batches``, counting them; the pass ends when they run out.

        ``generator_states``: under a feed that reads ahead, the state of the loader's
        generator after each batch was read, one per batch, in order; a checkpoint in the
        middle of the pass records the one of the last batch handed out.
        """
        run, repeats, this_pass = current(), self._repeats, self._passes
        try:
            for batch in batches:
                if generator_states is not None:
                    self._fed_generator = generator_states.popleft()
                self._position += 1
                if repeats is not None:
                    repeats.handed = self._position
                note(run, repeats)
                yield batch
            if repeats is not None:
                repeats.ended = True
            self._in_pass, self._fed_generator = False, None
        finally:
            if this_pass == self._passes:  # no later pass began (a left iterator collected late)
                for sampler in self._sharded_samplers():
                    sampler.padded = None  # outside a pass, len(loader) reads the scope again

    # -- checkpoint entry ------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The loader's checkpoint entry: every rank's position and random states.

        A collective: every rank calls it (``lite.save`` does). A loaded entry whose pass has
        not begun yet is returned as it was loaded, so a run stopped again before its first
        batch loses nothing. One state per share of the data (per data-parallel rank): the
        tensor-parallel ranks of a replica (``model_parallel``) read the same batches, and the
        first of them speaks for all, so a checkpoint's shares are those the data was dealt
        into, whatever the strategy.
        """
        if self._pending_entry is not None:
            return self._pending_entry
        local = self._local_state()
        run = current()
        by_share: dict[int, Any] = {}
        for r in range(run.world_size):
            share, state = broadcast((run.data_parallel_rank, local), src=r)
            by_share.setdefault(int(share), map_tensors(state, lambda t: t.cpu()))
        ranks = [by_share[share] for share in range(run.data_parallel_size)]
        return {"format": FORMAT, "world_size": run.data_parallel_size, "ranks": ranks}

    def load(self, entry: Any, *, rank: int | None = None, world_size: int | None = None) -> None:
        """Continue from ``entry`` (what :meth:`state` returned, possibly on another number
        of ranks): the loader's next pass finishes the saved one, or starts the saved next
        epoch. ``rank`` and ``world_size`` are the active run's share of the data unless given
        (its data-parallel rank and size: its global rank and world size but under
        ``model_parallel``)."""
        if not (isinstance(entry, dict) and entry.get("format") == FORMAT):
            raise ValueError(
                "The checkpoint entry for this loader is not a loader state written by "
                "lite.save (a loader from lite.setup_dataloader saved under the same key)."
            )
        run = current()
        rank = run.data_parallel_rank if rank is None else rank
        world_size = run.data_parallel_size if world_size is None else world_size
        ranks: list[dict[str, Any]] = entry["ranks"]
        mine = ranks[rank] if rank < len(ranks) else None
        self._iterated_before = bool(ranks[0]["iterated"])
        held = ranks[0].get("held")  # an epoch the script set holds (absent before it was saved)
        held = None if held is None else int(held)
        if not any(r["in_pass"] for r in ranks):  # saved between passes
            self.epochs.restore(int(ranks[0]["epoch"]), held)
            if mine is not None:
                rng.restore(mine["rng"], self.loader.generator)
            return
        epoch = int(next(r["epoch"] for r in ranks if r["in_pass"]))
        self._pending = self._pending_pass(epoch, ranks, mine, world_size)
        self._pending_entry = entry
        self.epochs.restore(epoch, held)

    def _pending_pass(
        self, epoch: int, ranks: list[dict[str, Any]], mine: dict[str, Any] | None, world_size: int
    ) -> Pending:
        before = Interrupted.from_state(ranks[0]["resumed"])
        if len(ranks) == world_size and mine is not None:
            reshard = mine.get("reshard_seed")
            return Pending(
                epoch, int(mine["position"]), mine["pass_rng"], mine["rng"], before, bool(mine["drew_seed"]), reshard
            )
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
        return Pending(epoch, 0, None, mine["rng"] if mine is not None else None, interrupted, True, reshard)

    def _local_state(self) -> dict[str, Any]:
        """This rank's part of the checkpoint entry."""
        if self._in_pass and self._position > 0:
            _refuse_mid_pass(self.loader)
        samplers = self._sharded_samplers()
        resumed = samplers[0].resumed if samplers else None
        reshard_seed = None
        if self._in_pass and self._pass_reshard is not None:
            reshard_seed, resumed = self._pass_reshard
        return {
            "in_pass": self._in_pass,
            "epoch": self._pass_epoch if self._in_pass else self.epochs.next,
            "held": self.epochs.held,
            "position": self._position,
            "taken": min(self._position * self._units_per_batch(), self._pass_share),
            "padded": self._pass_padded,
            "drop_last": bool(getattr(samplers[0], "_drop_last", False)) if samplers else False,
            "sharded": bool(samplers) or reshard_seed is not None,
            "seed": samplers[0].seed if samplers else reshard_seed,
            "reshard_seed": reshard_seed,
            "resumed": resumed.to_state() if resumed is not None else None,
            "pass_rng": self._pass_rng,
            "rng": self._random_states(),
            "drew_seed": self._pass_drew_seed,
            "iterated": self._iterated_here or self._iterated_before,
        }

    def _random_states(self) -> dict[str, Any]:
        """The random states a resumed pass continues from: those of now, except the
        loader's generator under a feed that read ahead (see :meth:`counted`)."""
        states = rng.capture(self.loader.generator)
        if self._in_pass and self._fed_generator is not None:
            states["generator"] = self._fed_generator
        return states

    def _sharded_samplers(self) -> list[Any]:
        return [h for h in self.epochs.holders if isinstance(h, (ShardedSampler, ShardedBatchSampler))]

    def _where_repeats(self) -> PassRepeats | None:
        """Where this rank's share of a padded pass repeats an item (see ``repeats.py``),
        or None: nothing repeats here, or not in rows a gather can tell (no batching)."""
        batch_sampler = self.loader.batch_sampler
        if isinstance(batch_sampler, ShardedBatchSampler):
            if batch_sampler.repeats() == 0:
                return None
            last = len(batch_sampler) - 1
            return PassRepeats(last, batch_sampler.last_length, batch_sampler.last_length, batch_sampler.share_rows)
        sampler = getattr(batch_sampler, "sampler", None)
        rows = sampler.repeats() if isinstance(sampler, ShardedSampler) else 0
        if rows == 0:
            return None
        size, items = self._units_per_batch(), self._pass_share  # the sampler's items in this pass
        batch = (items - 1) // size
        if batch_sampler.drop_last and batch >= items // size:
            return None  # the repeat is in the incomplete last batch, which is dropped
        return PassRepeats(batch, lambda: rows, lambda: items - batch * size, lambda: items)

    def _units_per_batch(self) -> int:
        """Sampler items per batch: the batch size when our sampler sits in a ``BatchSampler``,
        1 when it yields whole batches itself or the loader has no batching."""
        batch_sampler = self.loader.batch_sampler
        if batch_sampler is None or isinstance(batch_sampler, ShardedBatchSampler):
            return 1
        return int(batch_sampler.batch_size)


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
