"""``lite.profile``: torch.profiler on the chosen ranks, one Chrome trace per rank and cycle.

The scope runs ``torch.profiler.profile`` with torch's own schedule (wait, warmup, active,
repeat) on each chosen rank and writes every active cycle as ``rank{R}.step{N}.pt.trace.json``
in one folder, so the traces of a run sit side by side and open in Perfetto or
``chrome://tracing`` (or TensorBoard's profiler plugin). On a rank that is not chosen, and with
``enabled=False``, nothing of torch's profiler is created: ``step()`` returns at once.
Profiling issues no collective, so ranks may choose differently or leave at different steps
(inside ``lite.join``) without waiting for each other.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, schedule

from scopedlite._api.current import current
from scopedlite._core.scope import Scope, ScopeError

__all__ = ["profile"]

_profile_var: contextvars.ContextVar[Any] = contextvars.ContextVar("scopedlite.profile", default=None)


def _count(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(
            f"lite.profile({name}={value!r}): {name} must be an int >= {least}, e.g. "
            f"`lite.profile({name}={max(least, 1)})`."
        )
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"lite.profile({name}={value!r}): {name} must be True or False.")
    return value


def _ranks(value: object) -> frozenset[int] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"lite.profile(ranks={value!r}): ranks must be None (every rank) or a list of global "
            "ranks, e.g. `lite.profile(ranks=[0])`."
        )
    chosen = list(value)
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad or not chosen:
        raise ValueError(
            f"lite.profile(ranks={value!r}): ranks must be a non-empty list of global ranks "
            f"(ints >= 0){f'; not {bad!r}' if bad else ''}, e.g. `lite.profile(ranks=[0, 1])`, "
            "or None for every rank."
        )
    return frozenset(chosen)


class _Profile(Scope["_Profile"]):
    """The scope of :func:`profile`; ``with ... as prof`` gets the scope itself."""

    _var = _profile_var

    def __init__(
        self,
        folder: str | os.PathLike[str],
        ranks: Iterable[int] | None,
        wait: int,
        warmup: int,
        active: int,
        repeat: int,
        record_shapes: bool,
        profile_memory: bool,
        with_stack: bool,
        enabled: bool,
    ) -> None:
        if not isinstance(folder, (str, os.PathLike)) or not str(folder):
            raise TypeError(
                f"lite.profile(folder={folder!r}): folder must be a non-empty path (str or "
                "pathlib.Path), e.g. `lite.profile(folder='profiles')`."
            )
        self._folder = Path(folder)
        self._ranks = _ranks(ranks)
        self._schedule = (
            _count("wait", wait, 0),
            _count("warmup", warmup, 0),
            _count("active", active, 1),
            _count("repeat", repeat, 0),
        )
        self._options = {
            "record_shapes": _flag("record_shapes", record_shapes),
            "profile_memory": _flag("profile_memory", profile_memory),
            "with_stack": _flag("with_stack", with_stack),
        }
        self._enabled = _flag("enabled", enabled)
        self.profiler: torch.profiler.profile | None = None
        self.traces: list[Path] = []

    def describe(self) -> str:
        return f"lite.profile(folder={str(self._folder)!r})"

    @property
    def enabled(self) -> bool:
        """Whether this rank records (it was chosen and ``enabled=True``)."""
        return self.profiler is not None

    @property
    def folder(self) -> Path:
        """The folder the traces are written to (as given, relative to the working directory)."""
        return self._folder

    def step(self) -> None:
        """Mark the end of one training step, as ``torch.profiler.profile.step()``: the schedule
        counts these calls. Does nothing on a rank that does not record."""
        if self.profiler is not None:
            self.profiler.step()

    def _enter(self) -> _Profile:
        if _profile_var.get() is not None:
            raise ScopeError(
                "lite.profile is already open in this context; torch's profiler does not nest. "
                "Open one `with lite.profile(...) as prof:` around the loop."
            )
        run = current()
        if self._ranks is not None:
            outside = sorted(r for r in self._ranks if r >= run.world_size)
            if outside:
                raise ValueError(
                    f"lite.profile(ranks={sorted(self._ranks)!r}): rank(s) {outside} do not exist "
                    f"in a world of {run.world_size}; valid ranks are 0..{run.world_size - 1}, "
                    "e.g. `lite.profile(ranks=[0])`."
                )
        if not self._enabled or (self._ranks is not None and run.global_rank not in self._ranks):
            return self
        activities = [ProfilerActivity.CPU]
        if run.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._rank = run.global_rank
        wait, warmup, active, repeat = self._schedule
        self._folder.mkdir(parents=True, exist_ok=True)  # every rank: on a shared or a local disk
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
            on_trace_ready=self._write,
            **self._options,
        )
        self.profiler.__enter__()
        return self

    def _write(self, prof: torch.profiler.profile) -> None:
        path = self._folder / f"rank{self._rank}.step{prof.step_num}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        # Leaving during an active cycle writes what it recorded (torch's stop()); leaving in
        # wait or warmup writes nothing. The block's exception always propagates.
        if self.profiler is not None:
            self.profiler.__exit__(exc_type, exc, tb)
        return None


def profile(
    folder: str | os.PathLike[str] = "profiles",
    *,
    ranks: Iterable[int] | None = None,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    repeat: int = 1,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    enabled: bool = True,
) -> _Profile:
    """Profile the block with torch.profiler on every rank (or ``ranks``): ``with lite.profile() as prof:``.

    Call ``prof.step()`` once per training step: torch's schedule skips ``wait`` steps, warms
    up for ``warmup`` and records ``active``, ``repeat`` times (0: until the block ends). Each
    recorded cycle is written as ``{folder}/rank{R}.step{N}.pt.trace.json`` (``R`` the global
    rank, ``N`` the step it ended at), a Chrome trace holding the rank's operators and its
    collectives (``c10d::allreduce_`` and the backend's ``gloo:all_reduce`` / ``nccl:...``);
    ``prof.traces`` lists the files this rank wrote. CUDA activity is recorded when the run's
    device is a GPU. A rank that leaves the block during an active cycle (an exception, or
    running out of data inside ``lite.join``) writes what it recorded so far; one that leaves
    before its first active step writes none.

    On a rank not in ``ranks``, and with ``enabled=False``, the scope does nothing and
    ``prof.step()`` returns at once, so the calls can stay in the loop. Outside a launch block
    the default one-process run is profiled, as rank 0. Profiling issues no collective.

    Args:
        folder: Where the traces go, created if missing (on every recording rank; with several
            machines, a shared folder gathers them in one place). Existing files of the same
            name are overwritten.
        ranks: Global ranks that record; ``None`` for every rank.
        wait: Steps skipped at the start of each cycle.
        warmup: Steps profiled but not kept, before the recorded ones.
        active: Steps recorded per cycle (at least 1).
        repeat: Number of cycles; 0 repeats until the block ends.
        record_shapes: Record the input shapes of each operator (torch.profiler's argument).
        profile_memory: Record tensor allocations and frees (torch.profiler's argument).
        with_stack: Record the Python stack of each operator (torch.profiler's argument).
        enabled: ``False`` turns the scope into a no-op on every rank.

    Raises:
        ValueError: A count below its minimum, or a rank outside the world.
        TypeError: An argument of the wrong type.
        ScopeError: ``lite.profile`` is already open in this context.
    """
    return _Profile(folder, ranks, wait, warmup, active, repeat, record_shapes, profile_memory, with_stack, enabled)
