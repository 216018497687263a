"""Every use of torch's private API, in one place, each with the reason it is unavoidable.

If a torch release changes one of these, this is the only file to fix. Checked against
torch 2.13.0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import distributed_c10d

__all__ = ["cpu_twin", "local_box", "set_group_timeout"]


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
    own. Checked against torch 2.3-2.13.
    """
    distributed_c10d._set_pg_timeout(timeout)


def local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)``: where the part of the DTensor ``tensor`` that this rank holds
    lies in the whole tensor.

    Why private: loading a checkpoint into a sharded model reads, for each parameter, only
    the slice this rank holds, and DTensor has no public accessor for where that slice lies;
    ``compute_local_shape_and_global_offset`` is what DTensor's own checkpointing uses.
    Checked against torch 2.13.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offsets), tuple(sizes)
