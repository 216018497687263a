"""A collective over DTensors that the user's code starts runs on every rank together, or is
refused at once.

Under ``fsdp`` and ``model_parallel`` the parameters and gradients are DTensors, and some of
what torch computes from them reaches every rank: ``torch.nn.utils.clip_grad_norm_`` reduces
the sharded gradients' partial norms, ``p.full_tensor()`` gathers a parameter,
``p.redistribute(...)`` moves parts between ranks. Made on some ranks only (``if
run.is_global_zero:`` around a clip that logs the norm, a peek at a whole parameter), such a
call waits in a collective the other ranks never join; their next step's all-gather meets it
and the run hangs until the watchdog names it. It reaches the others through torch's
functional collectives, not a ``torch.distributed`` call, so for as long as the run is active
those functions are wrapped (``_private/torch_internals.functional_collectives``): a call
over every rank that the user's code started - not a model's forward, a backward, an
optimizer step, ours, FSDP's or DeepSpeed's (``join/guards.started_by_user``) - is first
checked against the other ranks in the gather ledger (``lockstep.py``), and refused on the
ranks that make it alone, naming what the others do and the fix, before anything is sent.

Inside ``lite.join`` the block's own guard (``join/guards.py``) wraps these and refuses such
calls there; a number read from a DTensor (``float(p.norm())``) is checked once, as a read,
by ``whole_numbers.py``. A collective over some ranks only (tensor parallelism's, within a
replica) is not checked: every rank of the world need not make one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

from scopedlite._core.dtensors import dtensor_class
from scopedlite._private.torch_internals import functional_collectives
from scopedlite._private.torch_patches import replaced
from scopedlite._strategies.join.guards import group_of, spans_every_rank, started_by_user
from scopedlite._strategies.join.members import in_join
from scopedlite._strategies.lockstep import GatherLedger

__all__ = ["dtensor_collectives_together"]


def dtensor_collectives_together(ledger: GatherLedger | None) -> contextlib.AbstractContextManager[None]:
    """For the run: a collective over every rank that the user's code starts on DTensors is
    made by every rank together (``ledger``) or refused (see the module docstring). Nothing
    to do on one rank (``ledger`` None) or before DTensor exists."""
    if ledger is None or dtensor_class() is None:
        return contextlib.nullcontext()
    module, names = functional_collectives()
    return replaced(module, names, lambda name, original: _together(name, original, ledger), layer="run")


def _together(name: str, original: Any, ledger: GatherLedger) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def together(*args: Any, **kwargs: Any) -> Any:
        if not in_join():  # the block's guard answers there
            caller = started_by_user()
            if caller is not None and spans_every_rank(group_of(signature, args, kwargs)):
                ledger.dtensor_collective(name, f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return original(*args, **kwargs)

    return together
