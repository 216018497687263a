"""``lite.save(path, state, blocking=False)``: the checkpoint written while training goes on.

Each rank copies what it writes to the CPU before the call returns (the snapshot: a later
optimizer step cannot leak into the checkpoint) and a thread writes the copy as the blocking
save would: rank 0 the one file (single, ddp, fsdp ``"full"``), or every rank its shards
through ``torch.distributed.checkpoint.async_save`` (fsdp, model_parallel). The run keeps
the save in flight (``_io.background``) where the next save, every load and the end of the
launch block find it and wait.

Waiting is collective: the ranks exchange whether their part failed (one all-reduce of a
flag, and only after a failure a gather of the messages), so every rank learns at once that
the checkpoint is complete, or which rank's write failed and why.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from scopedlite._api.join import active_session
from scopedlite._comm.wire import gather_objects
from scopedlite._core.run import Run, active_launch
from scopedlite._io.background import BackgroundSaves, BackgroundWrite, Exchange, SaveHandle
from scopedlite._io.files import state_dicts, write_atomically
from scopedlite._strategies.abilities import SupportsBackgroundCheckpoint, SupportsCheckpoint

__all__ = ["refuse_background", "run_saves", "start_save"]


def run_saves() -> BackgroundSaves:
    """The active run's save in flight: the open launch block's, else this process's
    default run's (outside any launch; waited for at interpreter exit)."""
    scope = active_launch()
    return scope.saves if scope is not None else _default_saves(os.getpid())  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1)
def _default_saves(pid: int) -> BackgroundSaves:
    # Keyed by pid, as the default run is: a forked child has no writer thread of its own.
    saves = BackgroundSaves()
    atexit.register(saves.close, True)  # a script that saved in the background keeps its file
    return saves


def start_save(run: Run, path: str | os.PathLike[str], state: dict[str, Any], saves: BackgroundSaves) -> SaveHandle:
    """Copy ``state`` on every rank and start writing it; the state's loaders are already
    entries (``checkpoint._loader_entry``) and the previous save has been waited for."""
    strategy = run.strategy
    target = Path(path).absolute()
    work: Callable[[threading.Event], None] | None
    if isinstance(strategy, SupportsBackgroundCheckpoint):
        work = strategy.start_checkpoint(target, state, saves.staging)
    else:
        converted = state_dicts(strategy, state)
        if run.is_global_zero:
            copied = saves.staging.copy(converted)
            work = functools.partial(write_atomically, target, copied)  # called with the stop event
        else:
            work = None
    handle = SaveHandle(target, BackgroundWrite(work, str(target)), _exchange(run))
    saves.pending = handle
    return handle


def refuse_background(run: Run) -> None:
    """Refuse ``blocking=False`` at once (every rank decides alike) where the strategy's own
    format has no background writer: DeepSpeed's engine writes its checkpoint itself."""
    strategy = run.strategy
    if isinstance(strategy, SupportsCheckpoint) and not isinstance(strategy, SupportsBackgroundCheckpoint):
        raise ValueError(
            f"lite.save(path, state, blocking=False) is not available under strategy={strategy.name!r}: "
            "the engine writes its checkpoint itself (engine.save_checkpoint), and DeepSpeed's own "
            "asynchronous checkpoint engines (Fast/Decoupled: its async_io op, built against libaio; "
            "DataStates: the datastates package) are not driven by scopedlite. Save blocking, "
            "`lite.save(path, state)`, or choose a strategy that writes in the background: 'single', "
            "'ddp', 'fsdp' or 'model_parallel'."
        )


def _exchange(run: Run) -> Exchange:
    """How the handle agrees with the other ranks when it is waited for (inside
    ``lite.join``: through the session, as every collective of ours there)."""

    def exchange(error: BaseException | None) -> list[tuple[int, str]]:
        mine = None if error is None else f"{type(error).__name__}: {error}"
        if run.world_size == 1:
            return [] if mine is None else [(0, mine)]
        session = active_session(run)
        peers: Any = session if session is not None else run.strategy
        flag = torch.tensor([0 if mine is None else 1], device=run.device)
        if int(peers.all_reduce(flag, "max").item()) == 0:
            return []
        every = gather_objects((run.global_rank, mine), peers.all_gather, run.device)
        return sorted((rank, text) for rank, text in every if text is not None)

    return exchange
