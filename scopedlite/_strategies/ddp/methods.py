"""The user's own methods of a DDP model: plain calls, synchronised only when back-propagated.

DDP prepares its gradient all-reduce in ``forward``, for a backward it expects to follow. A
method run through that forward but never back-propagated - ``model.num_params()`` or
nanoGPT's ``model.estimate_mfu()`` on rank 0, ``generate`` with gradients on - leaves the
reducer expecting one: that rank's next ``no_sync`` micro-step all-reduces anyway, one
collective ahead of the others, and the run drifts, then hangs.

So a user method is a plain call on the user's module, on any ranks, and prepares nothing.
If its result carries gradients it computed, that result passes through an identity whose
backward - reached on every rank that back-propagates it, before any gradient reaches a
parameter - prepares DDP's reducer as DDP's forward would have, with the gradient-sync flag
the method was called under (inside ``no_backward_sync`` it stays local). A backward that
also runs through the output of DDP's own forward, already prepared and reducing, is left as
it is. Inside ``lite.join`` such a backward is refused: a rank out of data replays forwards,
not the user's methods (join/members.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from scopedlite._private.torch_internals import ddp_reducer_is_reducing, ddp_syncs_gradients, prepare_ddp_backward
from scopedlite._strategies.join.members import in_join, refuse_backward_in_join
from scopedlite._strategies.method_results import on_backward

__all__ = ["ddp_method"]


def ddp_method(
    ddp: DistributedDataParallel, inner: torch.nn.Module, method: Callable[..., Any], name: str
) -> Callable[..., Any]:
    """``method`` (``inner``'s, called ``name`` in errors) as the set-up model answers it (see
    the module docstring)."""
    ref = weakref.ref(ddp)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        if not torch.is_grad_enabled():
            return result
        if in_join(inner):
            return on_backward(result, functools.partial(refuse_backward_in_join, name))
        sync = ddp_syncs_gradients(ddp)  # DDP decides at forward time; so do we
        if not sync:
            return result  # inside no_backward_sync: its backward accumulates locally
        if ddp.static_graph:
            return on_backward(result, functools.partial(_refuse_static_graph, name))
        keep = ddp.find_unused_parameters  # searched from the result for unused parameters
        return on_backward(result, functools.partial(_prepare, ref), keep_tensors=keep)

    return call


def _prepare(ref: weakref.ref[DistributedDataParallel], outputs: list[torch.Tensor]) -> None:
    ddp = ref()
    if ddp is None or ddp_reducer_is_reducing(ddp):
        return  # dropped, or this backward also runs through a forward's output, already reducing
    prepare_ddp_backward(ddp, outputs)


def _refuse_static_graph(method: str, _: list[torch.Tensor]) -> None:
    raise RuntimeError(
        f"The result of the model's own method {method}() was back-propagated under "
        "DDPStrategy(static_graph=True), which records the graph of forward only. Compute "
        "the loss in forward (`loss = model(x)`), or use lite.DDPStrategy(static_graph=False)."
    )
