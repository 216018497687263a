"""Which epoch each pass over a set-up loader is: the loader's own pass count.

torch's recipe (``sampler.set_epoch(epoch)`` before each epoch) and Lightning Fabric give a
loader's n-th pass epoch n, loader by loader, so a train and a validation loader iterated in
turn both count 0, 1, 2, ... Each loader of ``setup_dataloader`` does the same with its own
:class:`PassCount`, which hands the epoch to every sampler of the loader that takes one.

Two rules on top, both following only the program's own calls, so every rank agrees:

- A loader rebuilt over the same dataset object (inside the epoch loop, or per fold) starts
  where the last loader over that dataset stopped, rather than at 0, which would repeat its
  first order every epoch. :class:`EpochBook` remembers those counts, one book per run.
- ``lite.seed_everything`` starts those remembered counts afresh, so the same seed gives the
  same order, as in Fabric. Nothing crosses from one launch block to another, nor from one
  use of the default run (the stretch between two launch blocks) to the next.

An epoch the script sets on one of the loader's samplers holds, as it does in torch: once
``sampler.set_epoch(n)`` is called (on its own ``DistributedSampler``, as a torchrun script does,
or on ours, ``loader.sampler``), every pass reads epoch n until the next call. torch's tutorial
peeks at a batch (``next(iter(loader))``) before its epoch loop calls ``set_epoch(0)``: the
peek reads epoch 0 and the loop's epoch 0 must still read epoch 0, not 1. A peek is not counted
as a pass at all (:meth:`PassCount.begin`): a pass counts once its loop reads past its first
batch, or when it ends, so a peek on one rank only does not shift that rank's epochs. A call is
told from the loader's own hand-over by identity: the loader hands each epoch as a
:class:`_Handed` int, so a call of the script's stores another object, even for the same
number. ``loader.set_epoch(n)`` instead sets the next pass, from which the count goes on.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from scopedlite._api.sampler import ShardedBatchSampler, ShardedSampler, forward_epoch
from scopedlite._api.seed import Seeding, current_seeding
from scopedlite._core.process import this_process
from scopedlite._core.run import Run

__all__ = ["EpochBook", "PassCount", "book_of", "epoch_holders", "hand_epoch"]

# Datasets that cannot be referenced weakly (a list, a tuple, a range) are held by the book
# to keep their identity; only the most recent ones, so that a notebook re-running a cell does
# not keep every old list alive.
_HELD = 8


class _Dead:
    """The referent of a reference to a dataset that is gone (never any dataset)."""


_DEAD = _Dead()


def _reference(dataset: Any) -> Any:
    try:
        return weakref.ref(dataset)
    except TypeError:
        return dataset


def _referent(reference: Any) -> Any:
    if isinstance(reference, weakref.ref):
        target = reference()
        return _DEAD if target is None else target
    return reference


class EpochBook:
    """For each dataset that loaders of one run have read since the last ``seed_everything``,
    the epoch after the last pass any of them began.

    Args:
        run: The run whose loaders it counts.
        stretch: For the default run, how many launch blocks the process had entered when
            the book was opened (a later block ends this use of the default run); None for
            a launched run, whose book ends with it.
    """

    def __init__(self, run: Run, stretch: int | None) -> None:
        self.run = run
        self.stretch = stretch
        # id(dataset) -> (reference to it, the seeding it was counted under, next epoch)
        self._next: dict[int, tuple[Any, Seeding, int]] = {}

    def start(self, dataset: Any) -> int:
        """The first epoch of a loader set up now over ``dataset``: 0, or the count of the
        last loader over the same dataset when no re-seed came since its last pass."""
        entry = self._next.get(id(dataset))
        if entry is None:
            return 0
        reference, seeding, epoch = entry
        if _referent(reference) is not dataset or seeding is not current_seeding():
            return 0
        return epoch

    def began(self, dataset: Any, epoch: int) -> None:
        """A loader over ``dataset`` began a pass of ``epoch``: the next loader set up over
        it starts at ``epoch + 1``."""
        seeding = current_seeding()
        entry = self._next.pop(id(dataset), None)
        reference = entry[0] if entry is not None and _referent(entry[0]) is dataset else _reference(dataset)
        self._next[id(dataset)] = (reference, seeding, epoch + 1)  # the most recent last
        self._forget_old(seeding)

    def _forget_old(self, seeding: Seeding) -> None:
        for key, (reference, counted, _) in list(self._next.items()):
            if counted is not seeding or _referent(reference) is _DEAD:
                del self._next[key]
        held = [key for key, (reference, _, _) in self._next.items() if not isinstance(reference, weakref.ref)]
        for key in held[:-_HELD]:
            del self._next[key]


_books: contextvars.ContextVar[EpochBook | None] = contextvars.ContextVar("scopedlite.epochs", default=None)


def book_of(run: Run) -> EpochBook:
    """The epoch book of ``run``: a fresh one for each launch block and each use of the
    default run."""
    stretch = None if run.launched else this_process.blocks_entered()
    book = _books.get()
    if book is None or book.run is not run or book.stretch != stretch:
        book = EpochBook(run, stretch)
        _books.set(book)
    return book


def epoch_holders(loader: DataLoader) -> list[Any]:  # type: ignore[type-arg]
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


class _Handed(int):
    """An epoch as a loader hands it to its samplers: the number itself, but an object of its
    own, so that a later ``set_epoch`` of the script's, which stores another object (small ints
    are shared, so the same number would not do), is told from the loader's."""


# samplers whose ``epoch`` is only what ``set_epoch`` stored, so restamping it changes nothing
_PLAIN_EPOCH = (DistributedSampler, ShardedSampler, ShardedBatchSampler)


def _stamp(holders: list[Any]) -> None:
    """Give the samplers that keep their epoch plainly a :class:`_Handed` copy of it, so a
    call of the script's that stores the same number still shows (a fresh sampler holds
    Python's shared ``0``). Others' ``set_epoch`` may do more than store it, and is not called
    outside a pass."""
    for holder in holders:
        epoch = getattr(holder, "epoch", None)
        if type(holder) in _PLAIN_EPOCH and isinstance(epoch, int) and not isinstance(epoch, _Handed):
            holder.epoch = _Handed(epoch)


def hand_epoch(epoch: int, holders: list[Any]) -> None:
    """``set_epoch(epoch)`` once on each of ``holders``: on ours, which pass it on to the
    samplers they wrap, and on the others that none of ours wraps."""
    inner = set()
    for holder in holders:
        if isinstance(holder, ShardedSampler):
            inner.add(id(holder.sampler))
        elif isinstance(holder, ShardedBatchSampler):
            inner.update((id(holder.batch_sampler), id(getattr(holder.batch_sampler, "sampler", None))))
    forward_epoch(epoch, *(holder for holder in holders if id(holder) not in inner))


class PassCount:
    """One set-up loader's epochs: its passes are ``start``, ``start + 1``, ..., or the epoch
    the script set on one of its samplers, for every pass until the script sets another.

    Attributes:
        next: The epoch of the next pass, unless one is held.
        held: The epoch the script last set on a sampler of the loader, or None.

    Args:
        loader: The (sharded) loader whose samplers receive the epoch.
        start: The epoch of the first pass (see :meth:`EpochBook.start`).
        book: Where the passes are recorded for loaders rebuilt over the same dataset.
    """

    def __init__(self, loader: DataLoader, start: int, book: EpochBook) -> None:  # type: ignore[type-arg]
        self.next = start
        self.held: int | None = None
        self._uncounted: int | None = None  # the epoch of a pass begun and not yet counted
        self.holders = epoch_holders(loader)
        self._dataset = loader.dataset
        self._book = book
        self._seen = self._stamped()

    def begin(self) -> int:
        """Start a pass: hand its epoch to the samplers and return it. The pass is counted
        (the next one reads the following epoch) by :meth:`count`, once its loop reads past
        its first batch or it ends: a peek (``next(iter(loader))``, often on one rank only)
        is not a pass, or that rank would read another epoch's order than the others from
        then on, losing some samples and repeating others in every epoch."""
        chosen = self._set_by_script()
        if chosen is not None:
            self.held = chosen
        epoch = self.next if self.held is None else self.held
        hand_epoch(_Handed(epoch), self.holders)
        self._seen = self._epochs()
        self._uncounted = epoch
        return epoch

    def count(self) -> None:
        """The pass begun last reads past its first batch, or has ended: it counts (once)."""
        epoch, self._uncounted = self._uncounted, None
        if epoch is not None:
            self.next = epoch + 1
            self._book.began(self._dataset, epoch)

    def choose_next(self, epoch: int) -> None:
        """The next pass is ``epoch`` and the count goes on from it (``loader.set_epoch``);
        an epoch held since a sampler's ``set_epoch`` is let go."""
        self.next, self.held, self._uncounted = epoch, None, None

    def restore(self, epoch: int, held: int | None = None) -> None:
        """The next pass is ``epoch``, or ``held`` for every pass (a loaded checkpoint); the
        samplers' epochs as they are now are not the script's choice."""
        self.next, self.held, self._uncounted = epoch, held, None
        self._seen = self._stamped()
        if epoch > 0:
            self._book.began(self._dataset, epoch - 1)

    def _set_by_script(self) -> int | None:
        """The epoch last set on one of the loader's samplers since the last pass, if any:
        a script ported from torchrun or Fabric calls ``sampler.set_epoch(epoch)`` itself,
        possibly from a resumed epoch, and that value holds, as it would without us. A
        sampler of the user's whose ``set_epoch`` stores a converted number (not the object
        given) shows a call only when the number changes."""
        for holder in self.holders:
            epoch = getattr(holder, "epoch", None)
            if isinstance(epoch, int) and epoch is not self._seen.get(id(holder)):
                return int(epoch)
        return None

    def _stamped(self) -> dict[int, Any]:
        _stamp(self.holders)
        return self._epochs()

    def _epochs(self) -> dict[int, Any]:
        return {id(holder): getattr(holder, "epoch", None) for holder in self.holders}
