"""Every use of torch's private API, in one place, each with the reason it is unavoidable.

If a torch release changes one of these, this is the only file to fix. Checked against
torch 2.13.0.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.distributed import distributed_c10d
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

__all__ = ["cpu_twin", "joinables_configured", "no_sync_when_grad_disabled", "set_group_timeout", "settle_bucket_rebuild"]


@contextlib.contextmanager
def no_sync_when_grad_disabled(ddp: DistributedDataParallel) -> Iterator[None]:
    """Make an active rank's forward under ``torch.no_grad()`` announce "no backward sync".

    Why private: in join mode DDP's forward tells joined ranks whether a gradient all-reduce
    will follow through ``_check_global_requires_backward_grad_sync``, and it answers "yes"
    whenever ``no_sync`` is off, even in a ``no_grad`` evaluation loop where no backward ever
    runs. The joined ranks then wait for an all-reduce that never comes and the run hangs or
    aborts. No public hook can change that answer, so the method is shadowed on the instance
    for the duration of the join block and restored after.
    """
    name = "_check_global_requires_backward_grad_sync"
    original = getattr(ddp, name)

    def check(is_joined_rank: bool) -> Any:
        return original(is_joined_rank=is_joined_rank or not torch.is_grad_enabled())

    setattr(ddp, name, check)
    try:
        yield
    finally:
        if getattr(ddp, name, None) is check:
            delattr(ddp, name)  # the class's method shows through again


def settle_bucket_rebuild(ddp: DistributedDataParallel) -> None:
    """Carry out a pending gradient-bucket rebuild now, on every rank at once.

    Why private: after its first backward DDP rebuilds its buckets at the next forward *with
    grad enabled* (a broadcast from rank 0), while a joined rank's join hook rebuilds at the
    next forward of any kind. If the active ranks' next forward runs under ``no_grad`` (an
    evaluation loop in join) only the joined rank broadcasts, and the run hangs. Calling the
    rebuild at the start of the join block, where every rank is in the same state, settles
    it for all ranks together; with nothing pending it is local and free.
    """
    ddp.reducer._rebuild_buckets()


@contextlib.contextmanager
def joinables_configured(joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Iterator[None]:
    """Put ``joinables`` in join mode for the block, without torch's serving loop.

    Why private: torch's ``Join`` configures its joinables in ``__init__`` (DDP's forward
    starts notifying the joined ranks, the first joinable communicates) and serves the joined
    ranks in ``__exit__``. Our join session needs the first and replaces the second with its
    own loop, which also shadows our collectives; so ``Join`` is constructed for that side
    effect and constructed again with ``enable=False`` to undo it - a split torch does not
    document.
    """
    Join(list(joinables), enable=True, divide_by_initial_world_size=divide_by_initial_world_size)
    try:
        yield
    finally:
        Join(list(joinables), enable=False)


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
