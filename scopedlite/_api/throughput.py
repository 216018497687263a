"""``lite.throughput``: steps, samples, tokens and FLOPs per second, and MFU, to ``lite.log``.

Lightning Fabric's ``ThroughputMonitor`` and torchtitan's TPS/MFU as a scope. Every rank
counts its own steps (``meter.step(samples=..., tokens=...)``); every ``window`` steps the
ranks share their counts in one small all-gather (a row of six numbers per rank) and the
window's rates are logged through ``lite.log_dict``, at the window's last step.

**Ranks that ran out count nothing.** Inside ``lite.join`` the gather goes through the join
session, so it holds the rows of the ranks still running. While every rank has data the
counts are shared once per window; once the session's rounds run (some rank may run out
before the next window ends) they are shared at every step, so what a rank counted before it
ran out is in its window and nothing is counted after. A window closed while global rank 0
was out of data (it cannot log then) is kept by the running ranks and logged when the scope
closes, where every rank meets again.

**Time** is each rank's own clock between two exchanges; a window lasts as long as its
slowest rank took. The rates are the run's (summed over ranks, a data-parallel replica once);
``device/`` rates and MFU divide by the run's devices (``world_size``): a rank out of data
still holds its device.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
import warnings
from types import TracebackType
from typing import Any

import torch

from scopedlite._api.collectives import all_gather, gather_rows
from scopedlite._api.current import current
from scopedlite._api.join import active_session
from scopedlite._api.log import last_step, log_dict
from scopedlite._api.peak import peak_flops as table_peak
from scopedlite._core.scope import Scope

__all__ = ["throughput"]

# One rank's row: its data-parallel rank, what it counted since its last exchange, which
# quantities it was given (bits: a rate is logged only for those), how many exchanges it took
# part in, its step count, and how many windows it keeps for global rank 0.
_RANK, _STEPS, _SAMPLES, _TOKENS, _FLOPS, _SECONDS, _GIVEN, _EXCHANGES, _TOTAL, _KEPT = range(10)
_SAMPLES_GIVEN, _TOKENS_GIVEN, _FLOPS_GIVEN = 1, 2, 4
_FRESH = object()  # no step yet: the first step always exchanges


@dataclasses.dataclass
class _Window:
    """What the running ranks counted since the last window closed (the same on each)."""

    steps: int = 0
    samples: float = 0.0
    tokens: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0
    given: int = 0
    ranks: set[int] = dataclasses.field(default_factory=set)

    def add(self, rows: torch.Tensor, timed: torch.Tensor) -> None:
        """Add one exchange: every running rank's row. ``timed`` marks the ranks of the
        previous exchange, whose clocks and step counts ran through the interval; a rank that
        was out of data since brings its counts, not its time."""
        self.steps += int(rows[timed, _STEPS].max())
        self.samples += float(rows[:, _SAMPLES].sum())
        self.tokens += float(rows[:, _TOKENS].sum())
        self.flops += float(rows[:, _FLOPS].sum())
        self.seconds += float(rows[timed, _SECONDS].max())
        for given in rows[:, _GIVEN].tolist():
            self.given |= int(given)
        self.ranks |= {int(r) for r, steps in rows[:, [_RANK, _STEPS]].tolist() if steps > 0}

    def merge(self, other: _Window) -> None:
        for field in ("steps", "samples", "tokens", "flops", "seconds"):
            setattr(self, field, getattr(self, field) + getattr(other, field))
        self.given |= other.given


def _count(name: str, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{where}({name}={value!r}): {name} must be a number >= 0.")
    return float(value)


class _Throughput(Scope["_Throughput"]):
    """The scope of :func:`throughput`; ``with ... as meter`` gets the scope itself."""

    def __init__(
        self,
        window: int,
        flops_per_sample: float | None,
        flops_per_token: float | None,
        peak_flops: float | None,
        prefix: str,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"lite.throughput(window={window!r}): window must be an int >= 1, e.g. window=10.")
        if flops_per_sample is not None and flops_per_token is not None:
            raise ValueError(
                "lite.throughput: pass flops_per_sample or flops_per_token, not both (a step's "
                "FLOPs are counted from one of them, or given as meter.step(flops=...))."
            )
        for name, value in (("flops_per_sample", flops_per_sample), ("flops_per_token", flops_per_token)):
            if value is not None:
                _count(name, value, "lite.throughput")
        if peak_flops is not None and not _count("peak_flops", peak_flops, "lite.throughput") > 0:
            raise ValueError("lite.throughput(peak_flops=0): peak_flops is one device's FLOP/s, > 0.")
        if not isinstance(prefix, str):
            raise TypeError(f"lite.throughput(prefix={prefix!r}): prefix must be a str, e.g. 'throughput/'.")
        self.window = window
        self._per_sample = flops_per_sample
        self._per_token = flops_per_token
        self._given_peak = peak_flops
        self.prefix = prefix
        self.peak_flops: float | None = None
        self.steps = 0  # the run's steps in the block (the running ranks' count)

    def describe(self) -> str:
        return f"lite.throughput(window={self.window})"

    def _enter(self) -> _Throughput:
        self._run = run = current()
        self.peak_flops = self._given_peak if self._given_peak is not None else table_peak(run.device)
        self._warned = False
        if self._per_sample is not None or self._per_token is not None:
            self._no_peak(stacklevel=4)
        self._offset = last_step(self.prefix + "time") or 0  # a later meter continues the axis
        self._row = torch.zeros(10, dtype=torch.float64)
        self._row[_RANK] = run.data_parallel_rank
        self._clock = self._last = time.perf_counter()
        self._window = _Window()
        self._totals = _Window()
        self._kept: list[tuple[int, dict[str, float]]] = []  # windows global rank 0 did not see
        self._session: Any = _FRESH
        self._every = False  # the last step was shared at once (inside join's rounds)
        return self

    def step(self, samples: int | None = None, tokens: int | None = None, flops: float | None = None) -> None:
        """Count one training step of this rank: ``samples`` (rows of the batch), ``tokens``
        and ``flops`` (else ``flops_per_sample * samples`` or ``flops_per_token * tokens``).

        Every ``window`` steps it shares the counts with the other ranks and logs the rates;
        call it on every rank that ran the step, at the same line.
        """
        if self._state != "open":
            raise RuntimeError("meter.step() is called inside its `with lite.throughput(...) as meter:` block.")
        row = self._row
        if samples is not None:
            row[_SAMPLES] += _count("samples", samples, "meter.step")
            row[_GIVEN] = int(row[_GIVEN]) | _SAMPLES_GIVEN
        if tokens is not None:
            row[_TOKENS] += _count("tokens", tokens, "meter.step")
            row[_GIVEN] = int(row[_GIVEN]) | _TOKENS_GIVEN
        if flops is None and self._per_sample is not None and samples is not None:
            flops = self._per_sample * samples
        elif flops is None and self._per_token is not None and tokens is not None:
            flops = self._per_token * tokens
        if flops is not None:
            row[_FLOPS] += _count("flops", flops, "meter.step")
            row[_GIVEN] = int(row[_GIVEN]) | _FLOPS_GIVEN
        row[_STEPS] += 1
        self.steps += 1
        self._last = time.perf_counter()
        # Shared at once while a rank may run out (join's rounds), and at the first step after
        # that or in another join block, where a rank that ran out catches up; else at the
        # window's end. Every running rank decides alike (see docs/throughput.md).
        session = active_session(self._run)
        every = session is not None and session.shares_every_step()
        catch_up = session is not self._session or self._every
        self._session, self._every = session, every
        if every or catch_up or self.steps % self.window == 0:
            self._exchange(final=False)

    # -- exchanges -------------------------------------------------------------------------------
    def _exchange(self, final: bool) -> None:
        row = self._row.clone()
        row[_SECONDS] = self._last - self._clock
        row[_TOTAL] = self.steps
        row[_KEPT] = len(self._kept)
        rows = all_gather(row) if self._run.world_size > 1 else row.unsqueeze(0)  # the running ranks'
        self._clock = self._last
        self._row[_STEPS : _GIVEN + 1] = 0
        latest = rows[:, _EXCHANGES].max()
        timed = rows[:, _EXCHANGES] == latest  # the others ran out since: stale, and not timed
        has_zero = bool((rows[:, _RANK] == 0).any())  # global rank 0 takes part: it can log
        if not bool(timed.all()) or (has_zero and rows[:, _KEPT].max() > 0):
            self._catch_up(int(rows[timed, _RANK].min()))
        self._row[_EXCHANGES] = latest + 1
        self.steps = int(rows[:, _TOTAL].max())
        self._window.add(rows, timed)
        if final and self._window.steps == 0 and self._window.samples + self._window.tokens + self._window.flops > 0:
            self._left_over()
        elif not (final and self._window.steps == 0) and (final or self.steps % self.window == 0):
            window, self._window = self._window, _Window()
            self._totals.merge(window)
            self._kept.append((self._offset + self.steps, self._record(window, self._totals)))
        if has_zero:
            for at, record in self._kept:
                log_dict(record, step=at)
            self._kept.clear()

    def _left_over(self) -> None:
        """Counts that reached the others only as the block closed, after the last window
        (a rank counted steps and ran out of data before sharing them), are not rated."""
        if self._run.is_global_zero:
            w = self._window
            warnings.warn(
                f"lite.throughput: {w.samples:g} samples, {w.tokens:g} tokens and {w.flops:g} FLOPs "
                "counted by ranks that then ran out of data reached the others only at the end of "
                "the block, after the last window, and are in no logged rate. Call meter.step() "
                "at every step of the loop over a loader from lite.setup_dataloader (or inside "
                "lite.join's rounds), where each rank's last steps are shared as they happen.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _catch_up(self, holder: int) -> None:
        """Take the windows of data-parallel rank ``holder``, one that took part in every
        exchange, on every rank of this one (one gather of its pickled state)."""
        mine = int(self._row[_RANK]) == holder
        payload = pickle.dumps((self._kept, self._window, self._totals)) if mine else b""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if mine else torch.empty(0, dtype=torch.uint8)
        received = gather_rows(data.to(self._run.device)).cpu()
        self._kept, self._window, self._totals = pickle.loads(received.numpy().tobytes())

    def _no_peak(self, stacklevel: int) -> None:
        """FLOPs are counted but no peak is known: say once, on rank 0, that MFU is not logged."""
        run = self._run
        if self.peak_flops is None and not self._warned and run.is_global_zero:
            self._warned = True
            warnings.warn(
                f"lite.throughput logs no MFU: no peak FLOP/s is known for {run.device} in "
                f"{run.precision.name} (see lite.peak_flops). Pass the device's peak: "
                "`lite.throughput(..., peak_flops=312e12)`.",
                RuntimeWarning,
                stacklevel=stacklevel,
            )

    def _record(self, window: _Window, totals: _Window) -> dict[str, float]:
        p, seconds, devices = self.prefix, max(window.seconds, 1e-12), self._run.world_size
        record = {f"{p}steps_per_sec": window.steps / seconds}
        for name, bit in (("samples", _SAMPLES_GIVEN), ("tokens", _TOKENS_GIVEN), ("flops", _FLOPS_GIVEN)):
            if totals.given & bit:
                rate = getattr(window, name) / seconds
                record[f"{p}{name}_per_sec"] = rate
                record[f"{p}device/{name}_per_sec"] = rate / devices
                record[f"{p}{name}"] = getattr(totals, name)
        if totals.given & _FLOPS_GIVEN and self.peak_flops is not None:
            record[f"{p}mfu"] = window.flops / seconds / devices / self.peak_flops
        elif totals.given & _FLOPS_GIVEN:
            self._no_peak(stacklevel=5)
        record[f"{p}time"] = totals.seconds
        record[f"{p}ranks"] = float(len(window.ranks))
        return record

    # -- the end of the block ------------------------------------------------------------------------
    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if exc_type is None:  # after an exception the ranks are not together: nothing is shared
            self._exchange(final=True)  # every rank meets here (inside join: waits for the others)
        return None


def throughput(
    window: int = 10,
    *,
    flops_per_sample: float | None = None,
    flops_per_token: float | None = None,
    peak_flops: float | None = None,
    prefix: str = "throughput/",
) -> _Throughput:
    """Measure throughput and MFU over windows of steps: ``with lite.throughput() as meter:``.

    Call ``meter.step(samples=len(x), tokens=x.numel())`` once per training step on every
    rank. Every ``window`` steps, and once more for the last, shorter window when the block
    ends, the ranks' counts are summed and ``lite.log_dict`` gets, under ``prefix``:
    ``steps_per_sec``; ``samples_per_sec``, ``tokens_per_sec``, ``flops_per_sec`` and their
    ``device/`` versions (divided by ``world_size``) with the totals ``samples``, ``tokens``,
    ``flops`` for the quantities given; ``mfu`` (``device/flops_per_sec / peak_flops``,
    a fraction) when FLOPs are counted and the peak is known; ``time`` (seconds measured)
    and ``ranks`` (data-parallel ranks that counted in the window). The step is the step
    count at the window's end, continued from an earlier meter's last.

    Inside ``lite.join`` a rank that ran out of data counts nothing, and its steps before
    count in their window (see the module docs and docs/throughput.md). Each window costs
    one all-gather of 7 numbers per rank (at every step inside ``join`` once ranks may run
    out); on one process, none.

    Args:
        window: Steps per logged window.
        flops_per_sample: FLOPs of one sample's forward and backward (``lite.measure_flops``
            of a batch, divided by its size): a step counts ``flops_per_sample * samples``.
        flops_per_token: The same per token (torchtitan's ``6 N + 12 l h q t``).
        peak_flops: One device's peak FLOP/s for MFU; None looks the run's device and
            precision up in ``lite.peak_flops``'s table (none on CPU: no MFU, and a warning).
        prefix: Put before every logged name.
    """
    return _Throughput(window, flops_per_sample, flops_per_token, peak_flops, prefix)
