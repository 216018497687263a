"""Every use of torch's private API, in one place, each with the reason it is unavoidable.

If a torch release changes one of these, this is the only file to fix. Checked against
torch 2.13.0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import distributed_c10d

__all__ = ["cpu_twin", "set_group_timeout"]


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
