"""Every use of torch's private API, in one place, each with the reason it is unavoidable.

If a torch release changes one of these, this is the only file to fix. Checked against
torch 2.13.0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import distributed_c10d

__all__ = ["cpu_twin", "overwrite_buffers", "set_group_timeout"]


def cpu_twin(module: torch.nn.Module, cls: type[torch.nn.Module]) -> torch.nn.Module:
    """A shallow copy of ``module`` with full-size CPU tensors of its own and no children.

    Why private: FSDP's ``sharded_init`` must run one module's ``reset_parameters()`` on
    full-size tensors without building the whole model again. Only a module of the user's
    class, created without ``__init__`` (``object.__new__``: a sharded module's class would
    build FSDP state) and given its own ``_parameters``/``_buffers`` dicts, does that; no
    public constructor copies a module without its children.
    """
    twin = object.__new__(cls)  # the user's class: a sharded module's class builds FSDP state
    twin.__dict__.update(module.__dict__)
    twin._parameters = {
        n: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for n, p in module._parameters.items()
        if p is not None
    }
    twin._buffers = {
        n: torch.zeros(b.shape, dtype=b.dtype) for n, b in module._buffers.items() if b is not None
    }
    twin._modules = {}
    return twin


def set_group_timeout(timeout: Any) -> None:
    """Change how long the default process group's collectives wait, after it was created.

    Why private: a run we start creates its group under a generous start-up limit (a rank may
    still be importing torch while the others connect) and then bounds collectives by
    ``launch(timeout=)``. ``init_process_group`` takes one timeout for both; the public API
    has no way to change it afterwards, and ``_set_pg_timeout`` (gloo and NCCL) is torch's
    own. Checked against torch 2.9.0 and 2.13.0.
    """
    distributed_c10d._set_pg_timeout(timeout)


def overwrite_buffers(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Copy ``values`` into ``buffers`` in place without bumping their version counters.

    ``lite.join`` puts a module's buffers back after a replayed forward (and sets them from
    the running rank that DDP under torch's ``Join`` takes them from) between a forward and
    its backward.

    Why private: BatchNorm's backward saves the running statistics it was given, though in
    training it does not read them; a plain ``copy_`` would make that backward refuse to run.
    DDP's own buffer broadcast hides its copy the same way, with
    ``torch.autograd._unsafe_preserve_version_counter``. Checked against torch 2.13.
    """
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
        for buffer, value in zip(buffers, values):
            buffer.copy_(value)
