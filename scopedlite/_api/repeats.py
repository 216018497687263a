"""The rows a padded pass repeats, which ``lite.gather_for_metrics`` leaves out.

Outside ``lite.join`` a set-up loader pads its pass as ``DistributedSampler`` does: where the
data does not divide evenly, the last ranks' shares end with one repeated item (a sample, or
a whole batch under a user's batch sampler), so that every rank takes the same number of
batches. Gathered like any other row, a repeat is counted twice in a metric.

The repeat is the last item of a rank's share, so it lies in the last rows of the rank's last
batch. :class:`PassRepeats` says where, for the pass under way on this rank; the loader notes
the pass that handed out the latest batch in this context (:func:`note`), and
``gather_for_metrics`` asks it (:func:`without_repeats`) for each tensor it gathers:

- gathered on the batch that holds the repeat, a tensor with one row per sample of that
  batch (its first dimension is the batch's length) loses the repeated rows;
- gathered after the pass ended, a tensor with one row per sample of the whole pass (the
  batches' outputs concatenated) loses the same rows, its last ones;
- anything else gathered once the repeat was handed out (a per-batch sum, a few batches
  concatenated) may hold it, and cannot be cut: a warning says so, once per pass, and names
  the way out (gather per batch, or evaluate inside ``lite.join``, where nothing is padded).

HF Accelerate cuts the gathered rows of the last batch to the dataset's remainder, for every
tensor gathered then; here each rank cuts only its own repeated rows, and only from a tensor
whose rows are that batch's or that pass's samples.
"""

from __future__ import annotations

import contextvars
import warnings
import weakref
from typing import Any, Callable

import torch

__all__ = ["PassRepeats", "note", "without_repeats"]

# (the run, the pass that handed out the latest batch in this context)
_latest: contextvars.ContextVar[tuple[weakref.ref[Any], weakref.ref[PassRepeats]] | None] = contextvars.ContextVar(
    "scopedlite.latest_pass", default=None
)


class PassRepeats:
    """Where this rank's repeated rows lie in one padded pass, and how far the pass went.

    Args:
        batch: The index of the batch (in the pass) that holds the repeat.
        rows: How many of that batch's last rows repeat (the whole batch under a batch sampler).
        batch_length: That batch's number of rows, read when asked (a batch sampler's is
            known once the pass has drawn its order).
        total: The rows of the whole pass, read when asked.
    """

    def __init__(
        self, batch: int, rows: Callable[[], int], batch_length: Callable[[], int], total: Callable[[], int]
    ) -> None:
        self.batch = batch
        self._rows = rows
        self._batch_length = batch_length
        self._total = total
        self.handed = 0  # batches of the pass handed out
        self.ended = False  # the loop took every batch
        self.warned = False

    def cut(self, length: int) -> int:
        """How many last rows of a tensor of ``length`` rows gathered now repeat others."""
        if self.ended and length == self._total():
            return self._rows()
        if not self.ended and self.handed == self.batch + 1 and length == self._batch_length():
            return self._rows()
        return 0

    def reached(self) -> bool:
        """Whether the repeat was handed out."""
        return self.ended or self.handed > self.batch


def note(run: Any, repeats: PassRepeats | None) -> None:
    """The pass of ``run`` that handed out the latest batch in this context (None: a pass
    that repeats nothing on this rank)."""
    _latest.set(None if repeats is None else (weakref.ref(run), weakref.ref(repeats)))


def without_repeats(run: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` to gather for metrics, each without the rows this rank's latest padded
    pass repeated (see the module docstring)."""
    latest = _latest.get()
    repeats = latest[1]() if latest is not None and latest[0]() is run else None
    if repeats is None or not repeats.reached():
        return tensors
    kept = []
    for tensor in tensors:
        rows = repeats.cut(len(tensor))
        if rows == 0 and not repeats.warned:
            repeats.warned = True
            # stacklevel: the user's line that called lite.gather_for_metrics
            warnings.warn(_UNCUT.format(shape=tuple(tensor.shape), rank=run.global_rank), stacklevel=4)
        kept.append(tensor[: len(tensor) - rows] if rows else tensor)
    return kept


_UNCUT = (
    "lite.gather_for_metrics: the loader's last pass was padded outside lite.join (rank {rank}'s "
    "share ended with a repeated sample, as DistributedSampler pads), and a tensor of shape "
    "{shape} was gathered after the repeat was handed out, whose rows are neither that batch's "
    "nor the whole pass's samples: the repeat may be counted twice in it. Gather each batch's "
    "per-sample outputs (the repeated rows are left out there), or run the loop inside "
    "`with lite.join(model):`, where the loader pads nothing."
)
