"""The one place scopedlite replaces functions on torch's own modules and classes (checked on
torch 2.9-2.13). Two uses, each for a bounded time, each undone when it ends:

- :func:`replaced`, for as long as a ``lite.join`` block is open (below), and, for as long
  as a sharded run (``fsdp``, ``model_parallel``) is active, on ``DTensor``'s ways of becoming
  a Python number (``item``, ``__float__``, ...): torch reads a DTensor that is only this
  rank's part (a norm of sharded parameters) as that part, silently, and has no hook for
  such a read, so ``fsdp/whole_numbers.py`` reads the whole value there instead; and, for as
  long as a DeepSpeed run is active, on ``torch.nn.utils.clip_grad_norm_`` and
  ``clip_grad_value_``: the engine holds the gradients (every ``.grad`` is None), so torch
  would clip nothing, silently, and ``deepspeed/torch_clipping.py`` clips the engine's;
- :func:`noting_created`, for as long as a run is active: every new instance of some classes
  is handed to the run once it is built (LR schedulers: see the function).

Why ``replaced``: inside ``lite.join`` a rank that has run out of data answers only the join protocol's
rounds. A ``torch.distributed`` collective called by the user (or by a library such as
torchmetrics), a gradient norm over DTensors or ``DTensor.full_tensor()`` (collectives over
every rank without a ``torch.distributed`` call of their own) would wait for that rank until
the launch timeout, silently. torch has no public hook that runs before every collective
(its ``dist.register_*`` hooks cover work objects and process groups, not the call), so
``join/guards.py`` replaces those functions on torch's namespaces with wrappers that refuse
calls from user code, and this module puts the originals back when the block ends. Code that
bound a function before the block (``from torch.distributed import all_reduce``) is not
covered.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any, Callable

__all__ = ["noting_created", "replaced"]

_MARK = "__scopedlite_replaced__"


@contextlib.contextmanager
def replaced(owner: Any, names: Iterable[str], wrap: Callable[[str, Any], Any], layer: str = "block") -> Iterator[None]:
    """``owner.<name> = wrap(name, original)`` for each of ``names`` that ``owner`` has, until
    the block ends. A function replaced already by the same ``layer`` (an enclosing block's)
    is left as it is; one replaced by another layer is wrapped again (a ``lite.join`` block's
    guard around the run's: ``fsdp/dtensor_collectives.py``), and comes back when it ends."""
    saved: list[tuple[str, Any, bool]] = []  # (name, original, whether owner had it itself)
    try:
        for name in names:
            original = getattr(owner, name, None)
            if original is None or getattr(original, _MARK, None) == layer:
                continue
            wrapper = wrap(name, original)
            setattr(wrapper, _MARK, layer)
            saved.append((name, original, name in vars(owner)))
            setattr(owner, name, wrapper)
        yield
    finally:
        for name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:  # inherited (DTensor's __float__ is Tensor's): inherited again
                delattr(owner, name)


@contextlib.contextmanager
def noting_created(classes: Iterable[type], note: Callable[[Any], None]) -> Iterator[None]:
    """Hand every instance of ``classes`` (or of their subclasses) to ``note`` once its
    ``__init__`` has returned, until the block ends.

    Why: the join session must step, on a rank that ran out of data, the LR schedulers that
    the other ranks step, so it must know them; an optimizer does not know its schedulers,
    and torch has no hook that runs when one is built. So the ``__init__`` each class defines
    is wrapped for the block (a class without one of its own is left as it is); a subclass
    that calls its base's ``__init__`` is noted through it (once per class on its way up, so
    ``note`` may see an instance more than once). ``__new__`` would catch every subclass
    but cannot be put back: once assigned, CPython keeps the subclasses' constructor slot.
    """
    wrapped: list[tuple[type, Any]] = []
    try:
        for cls in classes:
            original = cls.__dict__.get("__init__")
            if original is None or getattr(original, _MARK, False):  # noted through its base
                continue

            def init(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
                __original(self, *args, **kwargs)
                note(self)

            functools.update_wrapper(init, original)
            setattr(init, _MARK, True)
            wrapped.append((cls, original))
            cls.__init__ = init  # type: ignore[misc]
        yield
    finally:
        for cls, original in reversed(wrapped):
            cls.__init__ = original  # type: ignore[misc]
