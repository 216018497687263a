"""The tensors our collectives hand to torch.distributed are let go in our thread, not gloo's.

gloo runs each collective in a worker thread of its own, which keeps the collective's tensors
until it moves on to the next one, a moment after the caller has its result. A tensor that
Python has seen and already dropped is then freed by that C++ thread, which must take the GIL
first, and a C++ thread taking the GIL creates a Python thread state under CPython's runtime
lock *without* holding the GIL. Measured on torch 2.13 over gloo (2 ranks): 23-42% of the
payloads of plain ``all_reduce``, ``broadcast`` and ``all_gather`` calls were freed by gloo's
thread.

That is what hangs a DataLoader worker in ``os.fork`` on CPython up to 3.11.9 (gh-112275):
the main thread forks while it holds the GIL, so no Python thread can hold the runtime lock
then, but a C++ thread creating its thread state can; the child inherits the lock held, and
takes it again, before re-creating it, to delete the other threads' states. It sits in
``PyOS_AfterFork_Child -> _PyEval_ReInitThreads -> _PyThreadState_DeleteExcept ->
PyThread_acquire_lock`` for ever. A set-up loader forks its workers at the start of each
pass, right after the collectives of the last step (and, inside ``lite.join``, the round that
opens the pass).

So each of our collectives gives its tensors to :func:`keep`, which lets go of them, oldest
first, only once nothing else holds them (gloo has moved on): they are then freed here, by the
thread that made them, under the GIL. Large payloads (a broadcast checkpoint) are not held, so
that nothing big outlives its collective; they are rare beside the per-step ones, a few bytes
each. Should a tensor stay held elsewhere (the caller keeps a view of a result), the oldest
entries go once ``_HELD`` are waiting, as they went before.
"""

from __future__ import annotations

import collections

import torch

from scopedlite._private.torch_internals import held_by_python_only

__all__ = ["keep"]

_HELD = 64
# Payloads above this are not held (see the module docstring).
_LARGEST = 1 << 20

_recent: collections.deque[tuple[torch.Tensor, ...]] = collections.deque(maxlen=_HELD)


def keep(*tensors: torch.Tensor | None) -> None:
    """Hold ``tensors``, just given to a collective, until nothing else holds them; let go of
    the earlier ones that nothing else holds any more."""
    while _recent and all(held_by_python_only(t) for t in _recent[0]):
        _recent.popleft()
    small = tuple(t for t in tensors if t is not None and t.numel() * t.element_size() <= _LARGEST)
    if small:
        _recent.append(small)
