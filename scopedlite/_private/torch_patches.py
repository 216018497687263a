"""The one place scopedlite replaces functions on torch's own modules and classes, for as
long as a ``lite.join`` block is open (checked on torch 2.9-2.13).

Why: inside ``lite.join`` a rank that has run out of data answers only the join protocol's
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
from collections.abc import Iterable, Iterator
from typing import Any, Callable

__all__ = ["replaced"]

_MARK = "__scopedlite_replaced__"


@contextlib.contextmanager
def replaced(owner: Any, names: Iterable[str], wrap: Callable[[str, Any], Any]) -> Iterator[None]:
    """``owner.<name> = wrap(name, original)`` for each of ``names`` that ``owner`` has, until
    the block ends. A function replaced already (an enclosing block's) is left as it is."""
    saved: list[tuple[str, Any]] = []
    try:
        for name in names:
            original = getattr(owner, name, None)
            if original is None or getattr(original, _MARK, False):
                continue
            wrapper = wrap(name, original)
            setattr(wrapper, _MARK, True)
            saved.append((name, original))
            setattr(owner, name, wrapper)
        yield
    finally:
        for name, original in reversed(saved):
            setattr(owner, name, original)
