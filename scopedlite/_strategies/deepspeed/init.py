"""ZeRO-3's ``sharded_init``: record the build, then partition one parameter at a time.

``deepspeed.zero.Init`` partitions each module's parameters as soon as its ``__init__``
returns, so any initialisation that runs later - a parent module's, Hugging Face's
``post_init()`` - writes into empty placeholders, and the model silently keeps other values
(GPT-2 then started training from a loss of 43.6 instead of 4.56). Here the block is recorded
on the meta device instead (``deferred/``); when it closes, each parameter in turn gets the
full value a plain build with the same seed gives it, in DeepSpeed's dtype, and is handed to
``deepspeed.zero.Init(module=...)`` (public API: "partition an already-allocated model"),
which partitions it. No rank holds more than one full parameter at a time. Buffers, which
ZeRO does not partition, get their full values.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch

from scopedlite._strategies.deferred.build import DeferredBuild

__all__ = ["zero3_build"]


@contextlib.contextmanager
def zero3_build(
    deepspeed: Any,
    config: dict[str, Any],
    empty: bool,
    agree: Any,
    device: torch.device,
    dtype: torch.dtype | None,
    remote_device: str | None,
    init_dtype: Any,
) -> Iterator[None]:
    """The ``sharded_init`` block under ZeRO-3 (see the module docstring)."""
    build = DeferredBuild(empty, agree)
    with init_dtype, build.recording():
        yield
    # memory_efficient_linear would replace torch.nn.functional.linear for the whole process.
    config = copy.deepcopy(config)
    config.setdefault("zero_optimization", {})["memory_efficient_linear"] = False
    partitioned: dict[int, torch.nn.Parameter] = {}  # by identity: tied parameters stay tied
    for module in build.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in partitioned:
                partitioned[id(param)] = _partition(deepspeed, config, build, param, device, dtype, remote_device)
            setattr(module, name, partitioned[id(param)])
        for name, buffer in list(module.named_buffers(recurse=False)):
            if build.owns(buffer):
                setattr(module, name, build.value(buffer).to(device, copy=True))


def _partition(
    deepspeed: Any,
    config: dict[str, Any],
    build: DeferredBuild,
    param: torch.nn.Parameter,
    device: torch.device,
    dtype: torch.dtype | None,
    remote_device: str | None,
) -> torch.nn.Parameter:
    value = build.value(param)
    target = dtype if dtype is not None and value.is_floating_point() else value.dtype
    full = torch.nn.Parameter(value.to(device=device, dtype=target, copy=True), requires_grad=param.requires_grad)
    full.__dict__.update(param.__dict__)  # what the model marked on it (e.g. _is_hf_initialized)
    holder = torch.nn.Module()
    holder.register_parameter("param", full)
    deepspeed.zero.Init(module=holder, config_dict_or_path=config, remote_device=remote_device)
    return full
