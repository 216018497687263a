"""Refusals of what a rank out of data cannot mirror inside ``lite.join``: raw torch calls
that are collectives over every rank.

A rank that has run out of data answers only the join protocol's rounds (``session.py``):
the models' forwards, backwards and steps, and our own collectives. A ``torch.distributed``
collective called from user code, or a norm or gather over DTensors, would wait for it until
the launch timeout; these guards make each such call raise at once instead, naming what to
use. They replace torch's functions for the block only, through ``_private/torch_patches.py``
(the one place that does, and why).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scopedlite._comm.debug import PACKAGE_DIR, is_users_own
from scopedlite._core.dtensors import dtensor_class, is_whole
from scopedlite._private.torch_internals import functional_collectives
from scopedlite._private.torch_patches import replaced

__all__ = [
    "from_library",
    "group_of",
    "refuse_distributed_norms",
    "refuse_dtensor_collectives",
    "refuse_raw_collectives",
    "spans_every_rank",
    "started_by_user",
]

# torch.distributed's collectives, as a user or a library (torchmetrics' compute()) calls them.
_RAW_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
# DeepSpeed's engine talks to torch.distributed from its own files (deepspeed.comm); found
# without importing it.
_DEEPSPEED_SPEC = importlib.util.find_spec("deepspeed")
_DEEPSPEED_DIR = (
    os.path.dirname(os.path.abspath(_DEEPSPEED_SPEC.origin)) + os.sep
    if _DEEPSPEED_SPEC is not None and _DEEPSPEED_SPEC.origin
    else _TORCH_DIR
)
_EQUIVALENT = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_object": "all_gather",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}


def refuse_raw_collectives(counted: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
    """Inside ``lite.join``, a ``torch.distributed`` collective called from outside torch and
    scopedlite raises at once instead of hanging.

    The ranks that ran out of data serve the join session's rounds (``session.py``), which
    replay the models' steps and answer our collectives only; a raw collective on an active
    rank would wait for them until the timeout (30 minutes by default), silently. Calls from
    torch's own code (DDP's gradient all-reduce, FSDP's gathers), DeepSpeed's and ours go
    through as they are, each told to ``counted`` (the session tells a forward that raised
    after its last gather from one that raised between two). Replaced on the
    ``torch.distributed`` namespace for the block only (``_private/torch_patches.py`` says why).
    """
    return replaced(dist, _RAW_COLLECTIVES, lambda name, original: _guarded(name, original, counted))


# torch functions that reach every rank through DTensor (FSDP2, model_parallel) without a
# torch.distributed call of their own: a gradient norm all-reduces over every rank.
_NORMS = ("clip_grad_norm_", "get_total_norm")


@contextlib.contextmanager
def refuse_distributed_norms() -> Iterator[None]:
    """Inside ``lite.join``, ``torch.nn.utils.clip_grad_norm_`` (as nanoGPT writes it) and
    ``get_total_norm`` over DTensor gradients, and ``DTensor.full_tensor()`` of a sharded
    tensor, called from outside torch and scopedlite, raise at once instead of hanging: each
    is a collective over every rank that the ranks which ran out of data cannot mirror (they
    replay the models' steps and our calls only). Over plain tensors (ddp) a norm is local
    and goes through. Replaced on ``torch.nn.utils``, ``torch.nn.utils.clip_grad`` and
    ``DTensor`` for the block only."""
    dtensor = dtensor_class()
    if dtensor is None:
        yield
        return

    def norm(name: str, original: Any) -> Any:
        return _guarded_norm(name, original, dtensor)

    with (
        replaced(torch.nn.utils, _NORMS, norm),
        replaced(torch.nn.utils.clip_grad, _NORMS, norm),
        replaced(dtensor, ["full_tensor"], lambda _, original: _guarded_full_tensor(original)),
    ):
        yield


# Where a DTensor collective is the models' own work, which the ranks out of data replay or
# mirror: a module's forward (tensor parallelism), an optimizer step, our code
# (lite.clip_gradients, the session's replays), FSDP's and DeepSpeed's; and a backward, seen
# by the torch functions that start one (torch/_tensor.py also holds Tensor.__pow__ & co, and a
# DTensor's redistribution is an autograd Function in the forward direction too).
_MIRRORED_DIRS = tuple(
    os.path.join(_TORCH_DIR, *part) for part in (("nn", "modules", ""), ("optim", ""), ("distributed", "fsdp", ""))
)
# (_DEEPSPEED_DIR is torch's own where DeepSpeed is not installed: torch's frames are not mirrored)
_MIRRORED = (*_MIRRORED_DIRS, PACKAGE_DIR) + ((_DEEPSPEED_DIR,) if _DEEPSPEED_DIR != _TORCH_DIR else ())
_BACKWARD_STARTS = {
    (os.path.join(_TORCH_DIR, "_tensor.py"), "backward"),
    (os.path.join(_TORCH_DIR, "autograd", "__init__.py"), "backward"),
    (os.path.join(_TORCH_DIR, "autograd", "__init__.py"), "grad"),
    (os.path.join(_TORCH_DIR, "autograd", "graph.py"), "_engine_run_backward"),
}


def refuse_dtensor_collectives(replicas: tuple[int, ...]) -> contextlib.AbstractContextManager[None]:
    """Inside ``lite.join``, an operation on DTensors called from the user's loop that reaches
    other data-parallel replicas (``float(sum(p.norm() ** 2 for p in model.parameters()))`` on
    FSDP's parameters, a sharded gradient's mean) raises at once instead of waiting for the
    ranks that ran out of data until the timeout. Those reach the others through torch's
    functional collectives, not a ``torch.distributed`` call, so they are guarded there
    (``_private/torch_internals.functional_collectives``). The models' forwards, backwards and
    optimizer steps go through (the ranks out of data replay them), and so does a collective
    within one replica (tensor parallelism's, e.g. ``loss_parallel``). ``replicas``: the
    data-parallel replica of each rank."""
    if dtensor_class() is None:
        return contextlib.nullcontext()
    module, names = functional_collectives()
    rank, block = dist.get_rank(), _block_frame()
    return replaced(module, names, lambda name, original: _guarded_functional(name, original, replicas, rank, block))


def _block_frame() -> Any:
    """The user's frame whose ``with lite.join(...)`` opens the block being entered."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith((PACKAGE_DIR, _CONTEXTLIB)):
        frame = frame.f_back
    return frame


def _guarded_functional(name: str, original: Any, replicas: tuple[int, ...], rank: int, block: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        caller = _loop_caller(block)
        if caller is not None and _spans_replicas(group_of(signature, args, kwargs), replicas, rank):
            raise _unmirrorable(
                f"A DTensor operation (torch's functional {name})",
                caller,
                "Compute it after the `with lite.join(...)` block, or on plain tensors: "
                "`lite.clip_gradients` for a gradient norm, `t.to_local()` for this rank's "
                "shard (then `lite.all_reduce` it, which stays correct inside the block).",
            )
        return original(*args, **kwargs)

    return guarded


def _loop_caller(block: Any) -> Any:
    """The user's frame that led to this DTensor collective from the body of the join block
    (``block``: the frame with its ``with`` statement), when nothing between that body and
    here is a model's forward, a backward, an optimizer step, ours, FSDP's or DeepSpeed's
    (see ``_MIRRORED_DIRS`` and ``_BACKWARD_STARTS``); else None (also where the call does
    not come from the block's body: another thread)."""
    return _user_frame(sys._getframe(2), block)


def started_by_user() -> Any:
    """Outside a ``lite.join`` block: the frame of the user's own code (not a library's, nor
    the standard library's: a thread's start) that led to the DTensor collective being
    called (the caller's caller of this function: a guard's), when nothing between the
    bottom of the stack and here is a model's forward, a backward, an optimizer step, ours
    (but our launcher's, which may run the script), FSDP's or DeepSpeed's; else None."""
    return _user_frame(sys._getframe(2), None)


def _user_frame(frame: Any, block: Any) -> Any:
    user = None
    while frame is not None:
        kind, path = _KINDS.get(frame.f_code.co_filename) or _kind(frame.f_code.co_filename)
        if kind == _MODELS_WORK or (path, frame.f_code.co_name) in _BACKWARD_STARTS:
            return None
        if user is None and kind != _TORCH and (block is not None or is_users_own(frame.f_code.co_filename)):
            user = frame
        if frame is block:
            return user
        frame = frame.f_back
    return user if block is None else None


_TORCH, _MODELS_WORK, _OTHER = "torch", "models", "other"
_KINDS: dict[str, tuple[str, str]] = {}  # co_filename -> (what its frames are, its absolute path)
# Ours that start the user's code rather than run a model's step: a worker's script may run
# under the launcher, or under the command line's runner.
_LAUNCHING = tuple(os.path.join(PACKAGE_DIR, *part) for part in (("_launch", ""), ("_cli.py",), ("__main__.py",)))


def _kind(filename: str) -> tuple[str, str]:
    path = os.path.abspath(filename)
    if path.startswith(_MIRRORED) and not path.startswith(_LAUNCHING):
        kind = _MODELS_WORK
    elif path.startswith(_TORCH_DIR):
        kind = _TORCH
    else:
        kind = _OTHER
    _KINDS[filename] = kind, path
    return kind, path


def group_of(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``group`` argument of a call of a functional collective (None where the call does
    not bind: torch says what is wrong with it)."""
    try:
        return signature.bind_partial(*args, **kwargs).arguments.get("group")
    except TypeError:
        return None


def spans_every_rank(group: Any) -> bool:
    """Whether a functional collective's ``group`` holds every rank of the world (False where
    it cannot be told)."""
    ranks = _ranks_of(group)
    return ranks is not None and len(set(ranks)) == dist.get_world_size()


def _spans_replicas(group: Any, replicas: tuple[int, ...], rank: int) -> bool:
    """Whether the functional collective's ``group`` holds ranks of another replica than this
    rank's (False where it cannot be told: such a call goes through, as before)."""
    ranks = _ranks_of(group)
    return ranks is not None and any(replicas[r] != replicas[rank] for r in ranks if 0 <= r < len(replicas))


def _ranks_of(group: Any) -> list[int] | None:
    # no DeviceMesh exists before its module is imported (and importing it costs ~0.1 s)
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", ())
    if isinstance(group, (tuple, list)) and len(group) == 2 and isinstance(group[0], mesh_type):
        group = group[0].get_group(group[1])
    elif isinstance(group, mesh_type):
        if group.ndim != 1:
            return None
        group = group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return list(dist.get_process_group_ranks(group))
    if isinstance(group, list) and all(isinstance(r, int) for r in group):
        return list(group)
    return None


def from_library(frame: Any) -> bool:
    """Whether ``frame`` runs torch's, DeepSpeed's or scopedlite's code, not the user's."""
    return os.path.abspath(frame.f_code.co_filename).startswith((_TORCH_DIR, PACKAGE_DIR, _DEEPSPEED_DIR))


def _user_caller() -> Any:
    """The frame that called the guarded function, when it is outside torch, DeepSpeed and
    scopedlite (their own calls are the join protocol's to keep in step); else None."""
    caller = sys._getframe(2)
    return None if from_library(caller) else caller


def _unmirrorable(call: str, caller: Any, fix: str) -> RuntimeError:
    return RuntimeError(
        f"{call} was called inside lite.join (at {caller.f_code.co_filename}:{caller.f_lineno}) "
        "on DTensors (fsdp, model_parallel): it is a collective over every rank, and the ranks "
        "that have run out of data have left the loop and cannot take part, so the ranks would "
        f"wait for each other until launch(timeout=) ran out, silently. {fix}"
    )


def _guarded_norm(name: str, original: Any, dtensor: type) -> Any:
    first = "tensors" if name == "get_total_norm" else "parameters"  # torch's name for it

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not args and first not in kwargs:
            return original(*args, **kwargs)  # torch says what is missing
        tensors = args[0] if args else kwargs.pop(first)
        args = args[1:]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # a generator: once
        caller = _user_caller()
        if caller is not None and any(isinstance(t if name == "get_total_norm" else t.grad, dtensor) for t in tensors):
            raise _unmirrorable(
                f"torch.nn.utils.{name}",
                caller,
                "Use lite.clip_gradients(model, optimizer, max_norm=...) inside the block: it "
                "clips on every rank, the ones out of data too.",
            )
        return original(tensors, *args, **kwargs)

    return guarded


def _guarded_full_tensor(original: Any) -> Any:
    @functools.wraps(original)
    def full_tensor(self: Any, *args: Any, **kwargs: Any) -> Any:
        caller = _user_caller()
        if caller is not None and not is_whole(self):
            raise _unmirrorable("DTensor.full_tensor()", caller, "Gather it after the `with lite.join(...)` block.")
        return original(self, *args, **kwargs)

    return full_tensor


def _guarded(name: str, original: Any, counted: Callable[[], None]) -> Any:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if from_library(caller):
            counted()
        else:
            ours = _EQUIVALENT.get(name)
            instead = f"use lite.{ours} inside the block (it stays correct on uneven data), or " if ours else ""
            raise RuntimeError(
                f"torch.distributed.{name} was called inside lite.join (at "
                f"{caller.f_code.co_filename}:{caller.f_lineno}). The ranks that have run out of "
                "data have left the loop and cannot take part, so the ranks would wait for each "
                "other until launch(timeout=) ran out, silently. "
                f"{instead[:1].upper() + instead[1:] if instead else ''}"
                f"{'call' if ours else 'Call'} it after the `with lite.join(...)` block: for a "
                "torchmetrics metric, `metric.update(...)` inside and `metric.compute()` after."
            )
        return original(*args, **kwargs)

    return guarded
