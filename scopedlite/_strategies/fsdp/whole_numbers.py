"""A Python number read from a sharded value is its whole value, read by every rank together,
or refused at once.

Under ``fsdp`` and ``model_parallel`` the parameters and gradients are DTensors: each rank
holds a part. What torch computes from them can stay a part: ``p.norm()`` and ``p.sum()`` of
a sharded parameter are *partial* (this rank's shard's norm or sum, to be combined with the
others'), and a sharded tensor is this rank's rows. Read as a Python number - ``float()``,
``int()``, ``bool()``, ``.item()``, ``.tolist()``, an f-string - torch returns this rank's
part without a word: a script that logs the parameters' norm, unchanged from one device,
logs a different, wrong number on each rank.

For as long as such a run is active, those reads, made by the user's code on a DTensor that
is not whole on this rank, read its whole value (``full_tensor()``, a collective) instead:

- every rank reads together, as the same step of the gather ledger (``lockstep.py``): a read
  on some ranks only (``if rank == 0: log(float(p.norm()))``) is refused at once on the ranks
  that make it, naming what the others do, instead of waiting in the collective;
- inside ``lite.join`` it is refused: the ranks that ran out of data cannot send their parts.

Reads by torch's, DeepSpeed's and our own code go through as they are (torch reads local
parts on purpose). Replicated DTensors are whole already and are read as they are.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

from scopedlite._core.dtensors import dtensor_class, is_whole
from scopedlite._private.torch_patches import replaced
from scopedlite._strategies.join.guards import from_library
from scopedlite._strategies.join.members import in_join
from scopedlite._strategies.lockstep import GatherLedger

__all__ = ["whole_numbers"]

# Tensor's ways of becoming Python numbers, each with what an error calls it.
_READS = {
    "item": ".item()",
    "tolist": ".tolist()",
    "__float__": "float()",
    "__int__": "int()",
    "__bool__": "bool()",
    "__format__": "an f-string",
}


def whole_numbers(ledger: GatherLedger | None) -> contextlib.AbstractContextManager[None]:
    """For the block: a number read by user code from a DTensor that is not whole on this
    rank is its whole value, read by every rank together (``ledger``) or refused (see the
    module docstring). Nothing to do on one rank (``ledger`` None) or before DTensor exists."""
    dtensor = dtensor_class()
    if ledger is None or dtensor is None:
        return contextlib.nullcontext()
    return replaced(dtensor, _READS, lambda name, original: _whole(name, original, ledger))


def _whole(name: str, original: Any, ledger: GatherLedger) -> Any:
    call = _READS[name]

    @functools.wraps(original)
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        # torch reads local parts on purpose; our code reads what it means to
        if is_whole(self) or (name == "__format__" and self.dim() != 0) or from_library(sys._getframe(1)):
            return original(self, *args, **kwargs)
        if in_join():
            raise RuntimeError(
                f"{call} of a DTensor that each rank holds only part of ({_parts(self)}) was "
                "called inside lite.join: its whole value needs every rank's part, and the ranks "
                "that have run out of data cannot send theirs. Read it after the `with "
                "lite.join(...)` block, or reduce a plain tensor with lite.all_reduce."
            )
        ledger.whole_value(f"{call} of a DTensor ({_parts(self)})")
        whole = self.full_tensor()
        return getattr(whole, name)(*args, **kwargs)

    return read


def _parts(tensor: Any) -> str:
    return ", ".join(str(placement) for placement in tensor.placements)
