"""ZeRO-3 parameters count their whole elements: ``p.numel()`` is the parameter's, not 0.

ZeRO-3 leaves each rank a slice of every parameter (``param.ds_tensor``) and, outside the
forward that gathers it, gives the parameter itself an empty placeholder: ``p.numel()`` is 0.
Scripts count parameters with it after setup - ``sum(p.numel() for p in
model.parameters())``, nanoGPT's ``get_num_params`` inside ``estimate_mfu``, Hugging Face's
``num_parameters()`` - and printed 0 parameters, or an MFU of 0, without a word (under FSDP
a sharded DTensor parameter answers its whole size). For the run, each ZeRO-3 parameter of a
set-up model is of :class:`WholeCountParameter`, a ``torch.nn.Parameter`` whose ``numel()``
and ``nelement()`` are the whole parameter's; when the run ends it is a plain ``Parameter``
again. A pickled parameter is a plain ``Parameter`` (torch rebuilds that class).

What it leaves as DeepSpeed has it: ``p.shape`` (the placeholder's ``torch.Size([0])``
outside forward; DeepSpeed's own code reads it, docs/strategies.md names ``p.ds_shape``), the
parameter's data, and every parameter before ``lite.setup`` (one partitioned by
``lite.sharded_init()``): DeepSpeed's engine and optimizer setup skips parameters whose
``numel()`` is 0 (``deepspeed.runtime.utils``), as a partitioned one's is, so the class is
given only to the engine's parameters, once the engine is built.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from scopedlite._private.deepspeed_internals import full_shape, is_zero3_parameter

__all__ = ["WholeCountParameter", "count_whole"]


class WholeCountParameter(torch.nn.Parameter):
    """A ZeRO-3 parameter whose element count is the whole parameter's (this module)."""

    def numel(self) -> int:  # type: ignore[override]
        return full_shape(self).numel()

    nelement = numel


def count_whole(module: torch.nn.Module, at_end: Callable[[Callable[[], None]], None]) -> None:
    """Give ``module``'s ZeRO-3 parameters :class:`WholeCountParameter` until the run ends
    (``at_end``: the run's, which calls what it is given then). Held weakly: a dropped model
    is still freed."""
    held = []
    for param in module.parameters():
        if type(param) is torch.nn.Parameter and is_zero3_parameter(param):
            param.__class__ = WholeCountParameter
            held.append(weakref.ref(param))
    if held:
        at_end(lambda: _plain_again(held))


def _plain_again(held: list[weakref.ref[torch.nn.Parameter]]) -> None:
    for ref in held:
        param = ref()
        if param is not None and type(param) is WholeCountParameter:
            param.__class__ = torch.nn.Parameter
