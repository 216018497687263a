"""``lite.current()``: the active run, or a default one-process run outside any launch."""

from __future__ import annotations

import functools
import os

import torch

from scopedlite._core.precision import PRECISIONS
from scopedlite._core.run import Placement, Run, active_launch
from scopedlite._strategies.single.strategy import SingleDeviceStrategy

__all__ = ["current"]


def current() -> Run:
    """Return the active run.

    Inside ``with lite.launch(...)`` that is the launched run, also in a thread started inside
    the block (threads start with empty context variables: the run open in this process is
    theirs; with launch blocks open in two threads, a third thread is refused rather than
    guessed for, and :func:`scopedlite.carry` hands a run over on purpose). Outside any launch
    a default single-process run on the best available device is returned (CUDA, else MPS,
    else CPU), so the same functions work in a plain script, a test or a notebook cell.

    Raises:
        RuntimeError: Called outside any launch block while several are open in this process.
    """
    scope = active_launch()
    if scope is not None:
        return scope.run  # type: ignore[no-any-return]
    return _default_run(os.getpid())


@functools.lru_cache(maxsize=1)
def _default_run(pid: int) -> Run:
    # Keyed by pid so a forked child builds its own default run instead of sharing one whose
    # strategy state (e.g. a gradient scaler) belongs to the parent.
    if torch.cuda.is_available():
        # current_device() would create a CUDA context, and a later fork launch would be refused
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        accelerator, device = "cuda", torch.device("cuda", index)
    elif torch.backends.mps.is_available():
        accelerator, device = "mps", torch.device("mps")
    else:
        accelerator, device = "cpu", torch.device("cpu")
    placement = Placement(
        global_rank=0,
        local_rank=0,
        node_rank=0,
        world_size=1,
        local_world_size=1,
        device=device,
        precision=PRECISIONS["32-true"],
        accelerator=accelerator,
    )
    strategy = SingleDeviceStrategy()
    strategy.start(placement, rendezvous=None)
    return Run.of(placement, strategy, launched=False)
