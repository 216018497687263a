"""Helpers shared by the measurement modules: running child processes, statistics, results.

The driver side of the benchmarks (this module, ``run.py`` and the measurement modules) never
imports torch: every number comes from a fresh child process, so the driver's own state
(threads, loaded libraries, page cache of torch) cannot leak into what is measured.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

BENCH_DIR = Path(__file__).resolve().parent
SCRIPTS_DIR = BENCH_DIR / "scripts"
REPO_ROOT = BENCH_DIR.parent
PYTHON = sys.executable

# One subprocess must never stall the whole run: a hang is reported, not waited for.
CHILD_TIMEOUT_S = 120.0


@dataclass
class Measurement:
    """One row of the results table.

    ``value``/``baseline`` are the headline numbers (in ``unit``); ``ratio`` is value/baseline
    for comparisons and None for absolute measurements, which are judged against ``goal``
    alone. ``met`` is None where there is no goal to judge against, or the run failed.
    """

    key: str
    title: str
    unit: str
    value: float | None
    baseline: float | None
    ratio: float | None
    goal: str
    met: bool | None
    method: str
    value_label: str = ""
    baseline_label: str = ""
    goal_fraction: float | None = None  # value / budget, for absolute goals (plotted)
    goal_ratio: float | None = None  # the ratio the goal asks for (plotted as a marker)
    note: str = ""
    verdict: str = ""  # overrides the plain yes/no in the table, e.g. when noise spans the goal
    raw: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ChildResult:
    """What a child process did: exit code, wall time from start to exit, output tail."""

    returncode: int | None
    wall_s: float
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        tail = (self.stderr or self.stdout).strip().splitlines()[-15:]
        state = "timed out" if self.timed_out else f"exit code {self.returncode}"
        return f"{state}; last output:\n" + "\n".join(tail)


def bench_env(**extra: str) -> dict[str, str]:
    """The environment every child runs in: one torch thread per process, no stray ranks.

    ``OMP_NUM_THREADS=1`` makes scopedlite and torchrun comparable (torchrun defaults to 1,
    scopedlite to cores // processes) and keeps the 2-core machine from oversubscribing.
    Variables that would make a child think it is already inside a launched world are removed.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCOPEDLITE_", "TORCHELASTIC_"))}
    for key in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "NODE_RANK",
    ):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def run_child(
    cmd: Sequence[str],
    env: dict[str, str] | None = None,
    timeout: float = CHILD_TIMEOUT_S,
    cwd: Path | None = None,
) -> ChildResult:
    """Run ``cmd`` to completion and time it from spawn to exit (``perf_counter``).

    The child leads its own process group so that, on a timeout, it and everything it
    started are killed together instead of lingering and disturbing the next measurement.
    It runs in the repository root unless ``cwd`` says otherwise.
    """
    start = time.perf_counter()
    process = subprocess.Popen(
        list(cmd),
        env=env if env is not None else bench_env(),
        cwd=cwd or REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = process.communicate()
        timed_out = True
    wall = time.perf_counter() - start
    return ChildResult(process.returncode, wall, out, err, timed_out)


def copy_package(dest: Path, compiled: bool) -> Path:
    """A copy of the ``scopedlite`` package under ``dest`` (for ``PYTHONPATH``), with its
    ``.pyc`` compiled if ``compiled``: what ``pip install`` leaves. This environment sets
    ``PYTHONDONTWRITEBYTECODE=1``, so the source tree itself is compiled again at every start
    (3-4x the import time), which no installed copy does. Returns ``dest``."""
    shutil.copytree(REPO_ROOT / "scopedlite", dest / "scopedlite", ignore=shutil.ignore_patterns("__pycache__"))
    if compiled:
        subprocess.run([PYTHON, "-m", "compileall", "-q", str(dest / "scopedlite")], check=True)
    return dest


_INSTALLED: list[Path] = []  # the compiled copy of this run, made on first use


def installed_env(**extra: str) -> dict[str, str]:
    """:func:`bench_env` with scopedlite imported from a compiled copy (made once per run,
    removed at exit), as an installed package is: the launch and whole-run measurements
    compare our start with torch's, which is installed and compiled."""
    if not _INSTALLED:
        tmp = Path(tempfile.mkdtemp(prefix="scopedlite-installed-"))
        atexit.register(shutil.rmtree, tmp, True)
        _INSTALLED.append(copy_package(tmp, compiled=True))
    return bench_env(PYTHONPATH=str(_INSTALLED[0]), **extra)


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def temp_path(suffix: str = ".json") -> Path:
    """A fresh path (the file does not exist yet) for a child to write its result to."""
    fd, name = tempfile.mkstemp(prefix="scopedlite-bench-", suffix=suffix)
    os.close(fd)
    os.unlink(name)
    return Path(name)


def free_port() -> int:
    """A TCP port free right now (for torchrun's static rendezvous; tiny race accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 < q < 1), linear between order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def noise_verdict(met: bool, ratios: Sequence[float], goal: float) -> str:
    """ "yes"/"no", qualified when the repeats disagree about which side of the goal we are."""
    plain = "yes" if met else "**no**"
    if ratios and min(ratios) <= goal < max(ratios):
        return f"{plain} (inconclusive: repeats {min(ratios):.3f}-{max(ratios):.3f} span the goal)"
    return plain


def spread(values: Sequence[float]) -> float:
    """Relative spread (max - min) / median: how much repeats of one variant disagree."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / median(values)


def safe_ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def log(message: str) -> None:
    """Progress on stderr, so a long run shows where it is."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def failed(key: str, title: str, goal: str, method: str, reason: str) -> Measurement:
    """A row for a measurement that could not be taken, with the reason instead of numbers."""
    return Measurement(key, title, "", None, None, None, goal, None, method, note=f"FAILED: {reason}")


@dataclass
class StepModes:
    """Per-step times of one launch's modes (``{"steps": {mode: [[s, ...] per block]}, "cpu": ...}``,
    what the ``*_steps.py`` scripts write): pooled medians, and ratios of a mode to a baseline."""

    steps: dict[str, list[list[float]]]
    cpu: dict[str, list[list[float]]]

    @classmethod
    def of(cls, data: dict[str, Any]) -> StepModes:
        return cls(data["steps"], data["cpu"])

    def pooled(self, mode: str) -> float:
        """The median step of ``mode`` over all its blocks (s)."""
        return median([t for block in self.steps[mode] for t in block])

    def ratio(self, mode: str, baseline: str) -> float | None:
        return safe_ratio(self.pooled(mode), self.pooled(baseline))

    def per_block(self, mode: str, baseline: str) -> list[float]:
        """Each block's median ratio (the blocks ran side by side)."""
        return [median(m) / median(b) for m, b in zip(self.steps[mode], self.steps[baseline])]

    def cpu_ratio(self, mode: str, baseline: str) -> float | None:
        """The ratio of pooled CPU time per step (``process_time``: less disturbed by other jobs)."""
        return safe_ratio(
            median([t for block in self.cpu[mode] for t in block]),
            median([t for block in self.cpu[baseline] for t in block]),
        )

    def measurement(
        self, key: str, title: str, mode: str, baseline: str, goal: float, method: str, labels: tuple[str, str]
    ) -> Measurement:
        """The row for ``mode`` against ``baseline`` with a goal of ``mode / baseline <= goal``
        (``labels``: what each is called in the table); the note lists the per-block ratios
        and the CPU ratio, and a caller appends what else it measured."""
        ratio, per_block = self.ratio(mode, baseline), self.per_block(mode, baseline)
        met = ratio is not None and ratio <= goal
        return Measurement(
            key=key,
            title=title,
            unit="ms",
            value=self.pooled(mode) * 1e3,
            baseline=self.pooled(baseline) * 1e3,
            ratio=ratio,
            goal=f"<= {goal} x {baseline}",
            goal_ratio=goal,
            met=met,
            verdict=noise_verdict(met, per_block, goal),
            method=method,
            value_label=f"{self.pooled(mode) * 1e3:.2f} ms ({labels[0]})",
            baseline_label=f"{self.pooled(baseline) * 1e3:.2f} ms ({labels[1]})",
            note=(
                f"per-block ratios {', '.join(f'{r:.3f}' for r in per_block)}; CPU time per step (process_time, "
                f"less disturbed by other jobs) {mode} / {baseline} {self.cpu_ratio(mode, baseline):.3f}"
            ),
            raw={"steps_s": self.steps, "cpu_s": self.cpu},
        )
