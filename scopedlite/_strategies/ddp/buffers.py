"""DDP's buffer broadcast, done at the end of the forward that owes it.

torch's DDP broadcasts rank 0's buffers (BatchNorm's running statistics) at the *start* of a
forward that follows a training forward. A forward that only rank 0 runs after training - an
evaluation under ``if run.is_global_zero:`` - therefore opens with a broadcast no other rank
joins, and the run hangs until the collective timeout (plain DDP hangs the same way).

So DDP's own broadcast is switched off and this one runs at the *end* of every forward that
DDP marks as owing one (grad enabled, gradients synchronised: ``require_forward_param_sync``)
in ``train()`` mode, while every rank is in that forward. Buffers change only inside forwards, so each forward
starts from the values torch's DDP would give it - rank 0's - and an evaluation forward, on
any ranks, has nothing left to synchronise. Inside ``lite.join`` the join session syncs the
buffers instead (from a running rank, as torch's ``Join`` does: ``ddp/join.py``).

What differs from torch: a buffer changed by hand on some ranks between a training forward and
the next forward (or between ``lite.setup`` and the first forward) is not overwritten with rank
0's at that next forward; broadcast it yourself (``lite.broadcast``) if you do that.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from scopedlite._comm.payloads import keep
from scopedlite._private.torch_internals import ddp_ignored_names, ddp_owes_buffer_sync, overwrite_buffers
from scopedlite._strategies.join.members import in_join

__all__ = ["broadcast_coalesced", "buffer_flag_name", "synced_buffers", "take_over_buffer_sync"]


def buffer_flag_name(model: DistributedDataParallel) -> str:
    """DDP's public switch for broadcasting buffers in forward: ``forward_sync_buffers`` from
    torch 2.13 (``broadcast_buffers`` is then a deprecated property over it), ``broadcast_buffers``
    before."""
    return "forward_sync_buffers" if "forward_sync_buffers" in vars(model) else "broadcast_buffers"


def synced_buffers(model: DistributedDataParallel) -> list[torch.Tensor]:
    """The buffers DDP would broadcast (those not in ``parameters_to_ignore``)."""
    ignored = ddp_ignored_names(model)
    return [b for n, b in model.module.named_buffers() if n not in ignored]


def take_over_buffer_sync(model: DistributedDataParallel, device: torch.device) -> bool:
    """Switch DDP's forward-start broadcast off and broadcast at the end of each training
    forward instead (see the module docstring). Returns whether ``model`` syncs buffers at all
    (``False`` where the user turned it off, or the model has none)."""
    name = buffer_flag_name(model)
    if not getattr(model, name) or not synced_buffers(model):
        return False
    setattr(model, name, False)
    inner = model.module

    def after_forward(ddp: Any, args: Any, output: Any) -> None:
        # DDP sets the flag in its post-forward: True after a forward whose backward syncs. In
        # eval() no buffer changes (BatchNorm reads its statistics), so nothing is owed: rank 0
        # evaluating alone without torch.no_grad() does not wait either.
        if ddp_owes_buffer_sync(ddp) and ddp.training and not in_join(inner):
            broadcast_coalesced(synced_buffers(ddp), 0, device)

    model.register_forward_hook(after_forward)
    return True


def broadcast_coalesced(tensors: list[torch.Tensor], source: int, device: torch.device) -> None:
    """Broadcast ``tensors`` from rank ``source`` in place, one message per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in group])
        dist.broadcast(flat, src=source)
        keep(flat)  # freed here, not by gloo's thread (_comm/payloads.py)
        values, offset = [], 0
        for tensor in group:
            values.append(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        overwrite_buffers(group, values)
