"""The user's own methods of a sharded model gather its parameters, as ``forward`` does.

FSDP2 all-gathers a unit's parameters in a hook around ``forward`` only; any other method of
the model (``model.features(x)``, ``model.generate(...)``) met sharded ``DTensor`` parameters
and failed ("got mixed torch.Tensor and DTensor"). Every method the user's classes define is
registered with ``torch.distributed.fsdp.register_fsdp_forward_method`` (public API), which
runs FSDP's pre- and post-forward around it: gather, and reshard afterwards, with the
backward hooks set on its outputs.

A registered method called while the model is already gathered (from ``forward``, or from
another of its methods) must run as it is: a second post-forward would reshard the
parameters under the outer call's feet. A depth count, kept by hooks around ``forward`` and
by the registered methods themselves, tells the two cases apart.

``save_pretrained`` (a Hugging Face model's) is not gathered like the others: every rank calls
it, the full state dict is gathered to rank 0 (``get_model_state_dict``), and rank 0 alone runs
the method with it, the methods it calls running plainly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from scopedlite._strategies.user_model import (
    SAVING_METHODS,
    saving_method,
    share_tied,
    user_method_names,
)

__all__ = ["gather_for_user_methods"]


def gather_for_user_methods(module: torch.nn.Module, user_class: type[torch.nn.Module]) -> list[str]:
    """Register the methods ``user_class`` defines on ``module``, a sharded root or unit;
    returns their names. (``type(module)`` after sharding is FSDP's subclass of the user's
    class, whose own methods are skipped as torch's.) Methods of a submodule that is not its
    own FSDP unit are not covered when called from outside (``model.encoder.encode(x)``): call
    them from a method of the model, or make the submodule a unit (``auto_wrap_policy``)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    names = user_method_names(user_class)
    depth = [0]

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    # prepend: counted before FSDP's own pre-forward hook, so a failing gather still leaves
    # through the always_call post hook that uncounts it.
    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)
    for name in names:
        plain = getattr(module, name)
        register_fsdp_forward_method(module, name)
        module.__dict__[name] = _outermost_gathers(plain, module.__dict__[name], depth)
    for name in SAVING_METHODS:
        method = getattr(module, name, None)
        if callable(method):
            module.__dict__[name] = saving_method(_as_gathered(method, depth), functools.partial(_full_state, module))
    return names


def _as_gathered(method: Callable[..., Any], depth: list[int]) -> Callable[..., Any]:
    """``method`` run as if the parameters were gathered: the methods it calls run plainly
    (``save_pretrained`` runs on rank 0 alone and reads the gathered state dict it is given)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        try:
            return method(*args, **kwargs)
        finally:
            depth[0] -= 1

    return call


def _outermost_gathers(plain: Callable[..., Any], gathered: Callable[..., Any], depth: list[int]) -> Callable[..., Any]:
    counted = _as_gathered(gathered, depth)

    @functools.wraps(plain)
    def call(*args: Any, **kwargs: Any) -> Any:
        return (plain if depth[0] else counted)(*args, **kwargs)

    return call


def _full_state(module: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return share_tied(module, state) if state else state
