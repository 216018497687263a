"""Checkpoints written in the background: a copy taken at the call, one write in flight.

``lite.save(path, state, blocking=False)`` returns once this rank holds a CPU copy of what it
writes (:class:`Staging`), so the training steps that follow cannot leak into the checkpoint;
a thread (:class:`BackgroundWrite`) then writes the copy the way the blocking save does,
atomically, and the :class:`SaveHandle` the call returns waits for it. A run keeps one write
in flight (:class:`BackgroundSaves`): the next save, a load and the end of the launch block
wait for it first, so a checkpoint is never read half-written, the copy's buffers are free
for the next save to reuse, and an error of the write is raised there rather than lost.

Waiting is agreed between the ranks (every rank waits at the same call, as every rank
saved): a rank is told that the checkpoint is complete only once every rank's part is, and a
write that failed on one rank raises on all, naming it. That exchange is the caller's (the
front end knows the run's collectives); this module holds the parts that need none.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from scopedlite._io.files import CheckpointError

__all__ = ["BackgroundSaves", "BackgroundWrite", "Exchange", "SaveHandle", "Staging"]

# How long a rank interrupted while waiting (Ctrl-C) gives its writer to stop and remove its
# temporary file before leaving it to die with the process.
_STOP_GRACE_S = 5.0

#: What a handle calls to agree with the other ranks: this rank's write error (or None) in,
#: every failed rank's ``(rank, "Type: message")`` out (empty: every rank's part is written).
Exchange = Callable[[BaseException | None], list[tuple[int, str]]]


class Staging:
    """CPU copies of what is saved, in buffers that the next save of the same tensors reuses.

    A save's copy is the snapshot: taken at the call, complete when it returns. Copying into
    the buffers of the previous save costs a memcpy, where fresh ones cost the allocation and
    first touch of every page, most of a first save's stall; the price is one copy of what
    is saved, held until the launch block ends. Two ways, one per kind of state:

    - :meth:`copy` (the single file): every plain tensor in the nest of dicts, lists and
      tuples goes to the buffer of the same memory (same storage, offset, shape, strides and
      dtype) in the previous save, the rest is deep-copied. Only the buffers of the latest
      save are kept, so a state whose tensors are new at every save (a gathered full state
      dict) holds one copy, not one per save. No part of ``torch.distributed`` is imported.
    - :attr:`stager` (a folder of shards, for ``torch.distributed.checkpoint.async_save``):
      torch's own ``DefaultStager`` (torch >= 2.9), which copies the local shards of DTensors
      into buffers kept by storage.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._stager: Any = None

    def copy(self, obj: Any) -> Any:
        """A deep copy of ``obj`` with every tensor on the CPU, in the reused buffers."""
        memo: dict[int, Any] = {}
        used: dict[tuple[Any, ...], torch.Tensor] = {}
        self._visit(obj, memo, used)
        copied = copy.deepcopy(obj, memo)  # the tensors found are taken from ``memo``
        self._buffers = used
        return copied

    def _visit(self, obj: Any, memo: dict[int, Any], used: dict[tuple[Any, ...], torch.Tensor]) -> None:
        if type(obj) is torch.Tensor:
            if id(obj) not in memo and obj.device.type != "meta":
                memo[id(obj)] = self._staged(obj, used)
        elif isinstance(obj, Mapping):
            for value in obj.values():
                self._visit(value, memo, used)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                self._visit(value, memo, used)

    @torch.no_grad()
    def _staged(self, tensor: torch.Tensor, used: dict[tuple[Any, ...], torch.Tensor]) -> torch.Tensor:
        key = (
            tensor.device,
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
            tensor.storage_offset(),
            tensor.untyped_storage().data_ptr(),
        )
        buffer = used.get(key)
        if buffer is None:
            buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=tensor.device.type == "cuda")
        buffer.copy_(tensor)
        used[key] = buffer
        return buffer

    @property
    def stager(self) -> Any:
        """torch's stager, made at the first save of a folder of shards (loads DCP)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # lazy: loads DCP

            options = StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,  # the copy is the snapshot: it must be complete at the call
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
        return self._stager

    def close(self) -> None:
        """Release the buffers (the launch block ends)."""
        self._buffers = {}
        if self._stager is not None:
            self._stager.close()
            self._stager = None


class BackgroundWrite:
    """One rank's part of one checkpoint, written by a daemon thread.

    Args:
        work: Writes the part; called in the thread with a ``threading.Event`` that is set
            when the write is to be abandoned. None: this rank writes nothing (its part is
            done at once).
        what: Names the thread (the checkpoint's path).
    """

    def __init__(self, work: Callable[[threading.Event], None] | None, what: str) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if work is None:
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"scopedlite save {what}", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[threading.Event], None]) -> None:
        try:
            work(self.stop)
        except BaseException as e:  # noqa: BLE001 - kept for the rank that waits, raised there
            self.error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self) -> BaseException | None:
        """Wait for the part here (no communication) and return its error, if any.

        Interrupted (Ctrl-C while waiting), the write is abandoned: a file's temporary copy is
        removed, a folder is not swapped in, and ``path`` keeps the previous checkpoint.
        """
        try:
            self._done.wait()
        except BaseException:
            self.stop.set()
            self._done.wait(_STOP_GRACE_S)
            raise
        return self.error


class SaveHandle:
    """What ``lite.save(path, state, blocking=False)`` returns: the checkpoint being written.

    The state was copied when ``save`` returned; ``wait()`` returns once the checkpoint is in
    place at ``path`` on every rank. Waiting is not required: the next ``lite.save``, a
    ``lite.load`` and the end of the launch block wait for it first.

    Attributes:
        path: Where the checkpoint appears (absolute), atomically: until then ``path`` holds
            the previous checkpoint, if any.
    """

    def __init__(self, path: Path, write: BackgroundWrite, exchange: Exchange) -> None:
        self.path = path
        self._write = write
        self._exchange = exchange
        self._finished = False
        self._error: CheckpointError | None = None

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "written" if self._finished else "in flight"
        return f"<lite.SaveHandle {str(self.path)!r} {state}>"

    def done(self) -> bool:
        """Whether this rank's part has been written (or has failed). Asks no other rank:
        the checkpoint is complete once ``wait()`` returns."""
        return self._finished or self._write.done()

    def wait(self) -> None:
        """Wait until the checkpoint is in place on every rank; call it on every rank.

        The ranks agree that every part is written (one small all-reduce), so every rank
        returns, or raises, together. A second call returns (or raises) at once.

        Raises:
            CheckpointError: A rank's write failed (on every rank, naming each rank that
                failed and its error; on that rank the error is the cause). The previous
                checkpoint at ``path``, if any, is still there.
            KeyboardInterrupt: Ctrl-C while waiting: the write is abandoned, the previous
                checkpoint stays.
        """
        if not self._finished:
            try:
                mine = self._write.join()
            except BaseException:
                self._finished = True  # abandoned (see BackgroundWrite.join): nothing left to wait for
                raise
            failures = self._exchange(mine)
            self._finished = True
            if failures:
                self._error = _failure(self.path, failures)
                if mine is not None:
                    self._error.__cause__ = mine
        if self._error is not None:
            raise self._error

    @property
    def waited(self) -> bool:
        """Whether :meth:`wait` (or :meth:`wait_here`) already ran: its outcome is known,
        and was raised to whoever waited."""
        return self._finished

    def wait_here(self) -> BaseException | None:
        """Wait for this rank's part only, asking no other rank (the block ends by an
        exception, where the others may not be waiting); return its error, if any."""
        if self._finished:
            return self._error
        self._finished = True
        return self._write.join()


def _failure(path: Path, failures: list[tuple[int, str]]) -> CheckpointError:
    each = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
    ranks = ", ".join(str(rank) for rank, _ in failures)
    return CheckpointError(
        f"lite.save({str(path)!r}, blocking=False) failed in the background on rank{'s' if len(failures) > 1 else ''} "
        f"{ranks} ({each}). Nothing was written to {str(path)!r}: it still holds the previous "
        "checkpoint, if there was one."
    )


class BackgroundSaves:
    """A run's checkpoint in flight (at most one), and the staging buffers its saves share."""

    def __init__(self) -> None:
        self.pending: SaveHandle | None = None
        self.staging = Staging()

    def wait(self) -> None:
        """Wait for the save in flight with the other ranks (see :meth:`SaveHandle.wait`):
        the next save and every load call this first, on every rank."""
        pending, self.pending = self.pending, None
        if pending is not None and not pending.waited:  # a failure the user waited for was raised to them
            pending.wait()

    def close(self, every_rank: bool) -> BaseException | None:
        """The block ends: wait for the save in flight and release the staging buffers.

        Args:
            every_rank: The block ended normally on this rank, so every rank waits here too:
                wait with them and raise a failed write (:meth:`SaveHandle.wait`). False (the
                block ends by an exception): wait for this rank's part only, and return its
                error instead, for the caller to attach to the exception being raised.
        """
        try:
            pending, self.pending = self.pending, None
            if pending is None or pending.waited:
                return None
            if every_rank:
                pending.wait()
                return None
            return pending.wait_here()
        finally:
            self.staging.close()
