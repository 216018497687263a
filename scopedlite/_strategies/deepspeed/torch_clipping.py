"""torch's own gradient clipping on a DeepSpeed model: exact, or refused at once.

Under DeepSpeed the gradients are the engine's: after ``lite.backward`` every parameter's
``.grad`` is None (ZeRO keeps them in its own buffers, partitioned from stage 2). So
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, as a DDP script writes it
(nanoGPT), found no gradient, returned a norm of 0.0 and clipped nothing: the run trained
unclipped, and a logged gradient norm read 0, silently.

For as long as a DeepSpeed run is active, ``clip_grad_norm_`` and ``clip_grad_value_`` called
by the user's code over parameters of a model set up in the run:

- clip that engine's full gradients as ``lite.clip_gradients`` does (DDP's clip of the
  averaged gradients, on every rank), when they are all of its trainable parameters;
- are refused with ``ValueError`` over part of them or over several models (each engine
  clips its whole model), and with ``RuntimeError`` inside ``lite.join`` (the full
  gradients are gathered from every rank, which the ranks out of data cannot take part in:
  ``lite.clip_gradients`` is mirrored there);
- are checked against the other ranks first (``together``: the gather ledger) and refused
  at once on a rank that clips alone (``if run.is_global_zero:`` around a clip that logs the
  norm), which would wait in the gather for the others' next step.

Other parameters (a plain model beside the engines) are clipped by torch as before. The
functions are replaced on ``torch.nn.utils`` and ``torch.nn.utils.clip_grad`` through
``_private/torch_patches.replaced`` (torch has no hook for them) and put back when the run ends.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from scopedlite._private.torch_patches import replaced
from scopedlite._strategies.deepspeed.engines import EngineRecord, clip_full_gradients
from scopedlite._strategies.join.guards import from_library
from scopedlite._strategies.join.members import in_join

__all__ = ["torch_clipping"]

_CLIPS = ("clip_grad_norm_", "clip_grad_value_")


# together(call, why, fix): returns when every rank makes ``call``, else raises
# (ProcessGroupStrategy.every_rank_calls).
Together = Callable[[str, str, str], None]


@contextlib.contextmanager
def torch_clipping(records: Callable[[], list[EngineRecord]], together: Together) -> Iterator[None]:
    """For the block: torch's clipping of a set-up engine's parameters is the engine's (see
    the module docstring). ``records``: the run's engines, asked at each call; ``together``:
    the check that every rank clips."""

    def wrap(name: str, original: Any) -> Any:
        return _clipping(name, original, records, together)

    with replaced(torch.nn.utils, _CLIPS, wrap), replaced(torch.nn.utils.clip_grad, _CLIPS, wrap):
        yield


def _clipping(name: str, original: Any, records: Callable[[], list[EngineRecord]], together: Together) -> Any:
    by_norm = name == "clip_grad_norm_"

    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)  # a generator: once
        record = None if from_library(sys._getframe(1)) else _engine_of(parameters, records(), name)
        if record is None:
            return original(parameters, *args, **kwargs)
        if in_join():
            raise RuntimeError(
                f"torch.nn.utils.{name} was called inside lite.join on the parameters of "
                f"{record.name}: under DeepSpeed it clips the engine's full gradients, gathered "
                "from every rank, and the ranks that have run out of data cannot take part. Use "
                "lite.clip_gradients(model, optimizer, max_norm=...) inside the block: it clips "
                "on every rank, the ones out of data too."
            )
        together(
            f"torch.nn.utils.{name}",
            "under DeepSpeed it clips the engine's full gradients, gathered from every rank",
            f"Clip on every rank, then use the result on one: `norm = torch.nn.utils.{name}("
            "model.parameters(), ...)` everywhere, `if run.is_global_zero: print(norm)`.",
        )
        if by_norm:
            return _clip_norm(record, *args, **kwargs)
        (clip_value,) = args or (kwargs.pop("clip_value"),)
        clip_full_gradients(record.engine, None, float(clip_value))
        return None

    return clip


def _clip_norm(
    record: EngineRecord,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` arguments, on the engine's full gradients (``foreach``,
    torch's choice of kernel, has nothing to choose here)."""
    total = clip_full_gradients(record.engine, float(max_norm), None, float(norm_type))
    assert total is not None
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so "
            "it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return total


def _engine_of(parameters: list[torch.Tensor], records: list[EngineRecord], name: str) -> EngineRecord | None:
    """The engine whose gradients ``parameters`` stand for: None where they are no engine's
    (torch clips them as before); refused where they are part of one, or of several."""
    given = {id(p) for p in parameters}
    owners = [r for r in records if r.parameter_ids & given]
    if not owners:
        return None
    trainable = {id(p) for p in owners[0].engine.module.parameters() if p.requires_grad}
    if len(owners) == 1 and trainable <= given <= owners[0].parameter_ids:
        return owners[0]
    if len(owners) > 1:
        what = f"parameters of several models set up in this run ({', '.join(r.name for r in owners)})"
    elif given <= owners[0].parameter_ids:
        what = f"parameters of {owners[0].name}, but not all it trains"
    else:
        what = f"parameters of {owners[0].name} and others"
    raise ValueError(
        f"torch.nn.utils.{name} got {what}: under DeepSpeed the gradients are the engine's "
        "(every parameter's .grad is None), so torch would clip nothing, and an engine clips its "
        "whole model's gradients. Clip each "
        "model whole: torch.nn.utils."
        f"{name}(model.parameters(), ...), or lite.clip_gradients(model, optimizer, max_norm=...), "
        "or set 'gradient_clipping' in the DeepSpeed config."
    )
