"""Measurement (b): what ``import scopedlite`` costs on top of ``import torch``.

Every sample is a fresh interpreter. The headline number is measured inside the child with
``perf_counter`` around ``import scopedlite`` *after* ``import torch`` (so torch's 1-2 s, and
its noise, are not part of it); the whole-process wall times of ``import torch`` alone and of
``import torch; import scopedlite`` are reported beside it as a cross-check.

Two bytecode states are measured, because they differ by a factor of about three:

- cached: a copy of the package with its ``.pyc`` files compiled (what ``pip install``
  leaves, and what any normal interpreter writes on first import);
- uncached: a copy without ``.pyc`` and ``PYTHONDONTWRITEBYTECODE=1``, so every module is
  compiled from source at every start (this environment sets that variable).

Copies on ``PYTHONPATH`` are used so that neither state writes into the source tree. The goal
is judged on the cached state.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from common import PYTHON, REPO_ROOT, Measurement, bench_env, failed, log, median, run_child, safe_ratio

GOAL_MS = 30.0
TORCH_ONLY = "import time, json; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); print(json.dumps({'torch_s': t1 - t0}))"
WITH_LITE = (
    "import time, json; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import scopedlite; t2 = time.perf_counter(); "
    "print(json.dumps({'torch_s': t1 - t0, 'lite_s': t2 - t1, 'file': scopedlite.__file__}))"
)
METHOD = (
    "fresh interpreters: perf_counter around `import scopedlite` after `import torch`, median of {n}; "
    "baseline = perf_counter around `import torch` alone; ratio = (torch + scopedlite) / torch; "
    "process walls (spawn to exit) shown as a cross-check, they carry ~0.1 s of noise"
)


def _copy_package(dest: Path, compiled: bool) -> None:
    shutil.copytree(REPO_ROOT / "scopedlite", dest / "scopedlite", ignore=shutil.ignore_patterns("__pycache__"))
    if compiled:
        subprocess.run([PYTHON, "-m", "compileall", "-q", str(dest / "scopedlite")], check=True)


def _run_import(code: str, env: dict[str, str], cwd: Path, expect_under: Path | None) -> tuple[dict[str, float], float]:
    # cwd matters: `python -c` puts it first on sys.path, and the repository root would
    # shadow the copy on PYTHONPATH.
    result = run_child([PYTHON, "-c", code], env, timeout=60, cwd=cwd)
    if not result.ok:
        raise RuntimeError(result.describe())
    data = json.loads(result.stdout.strip().splitlines()[-1])
    if expect_under is not None and not str(data["file"]).startswith(str(expect_under)):
        raise RuntimeError(f"imported scopedlite from {data['file']}, not from the copy in {expect_under}")
    return data, result.wall_s


def _breakdown(env: dict[str, str], cwd: Path) -> dict[str, object]:
    """``-X importtime`` of one cached import: scopedlite's slowest modules, and the modules
    outside scopedlite that it loads although torch had not (its real extra dependencies)."""
    result = run_child([PYTHON, "-X", "importtime", "-c", "import torch; import scopedlite"], env, timeout=60, cwd=cwd)
    rows: list[tuple[int, str]] = []
    after_torch = False
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        self_us, _cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
        if not self_us.isdigit():
            continue
        if after_torch:
            rows.append((int(self_us), name))
        elif name == "torch":
            after_torch = True
    ours = sorted((r for r in rows if r[1].startswith("scopedlite")), reverse=True)[:6]
    others = sorted((r for r in rows if not r[1].startswith("scopedlite")), reverse=True)
    return {
        "slowest_scopedlite_modules_ms": {name: us / 1e3 for us, name in ours},
        "other_modules_loaded": {name: us / 1e3 for us, name in others},
        "total_self_ms": sum(us for us, _ in rows) / 1e3,
    }


def measure(quick: bool) -> list[Measurement]:
    runs = 4 if quick else 7
    method = METHOD.format(n=runs)
    title = "import scopedlite after import torch"
    with tempfile.TemporaryDirectory(prefix="scopedlite-import-") as tmp:
        cached_dir, uncached_dir = Path(tmp) / "cached", Path(tmp) / "uncached"
        _copy_package(cached_dir, compiled=True)
        _copy_package(uncached_dir, compiled=False)
        envs = {
            "cached": bench_env(PYTHONPATH=str(cached_dir)),
            "uncached": bench_env(PYTHONPATH=str(uncached_dir), PYTHONDONTWRITEBYTECODE="1"),
        }
        torch_walls: list[float] = []
        torch_inside: list[float] = []
        lite: dict[str, list[float]] = {"cached": [], "uncached": []}
        walls: dict[str, list[float]] = {"cached": [], "uncached": []}
        try:
            for i in range(runs):
                order = ["torch", "cached", "uncached"]
                order = order[i % 3 :] + order[: i % 3]  # rotate: no variant always runs first
                for which in order:
                    if which == "torch":
                        data, wall = _run_import(TORCH_ONLY, bench_env(), Path(tmp), None)
                        torch_walls.append(wall)
                        torch_inside.append(data["torch_s"])
                    else:
                        copy = cached_dir if which == "cached" else uncached_dir
                        data, wall = _run_import(WITH_LITE, envs[which], Path(tmp), copy)
                        lite[which].append(data["lite_s"])
                        walls[which].append(wall)
            log(f"import: torch {median(torch_walls):.2f} s; scopedlite +{median(lite['cached']) * 1e3:.1f} ms cached, +{median(lite['uncached']) * 1e3:.1f} ms uncached")
            breakdown = _breakdown(envs["cached"], Path(tmp))
        except RuntimeError as e:
            return [failed("import_time", title, f"<= {GOAL_MS:.0f} ms", method, str(e))]

    rows = []
    for state, label in (("cached", "bytecode cached (.pyc, as pip installs it)"), ("uncached", "no bytecode cache (PYTHONDONTWRITEBYTECODE=1, as here)")):
        ms = median(lite[state]) * 1e3
        wall_with, wall_without = median(walls[state]), median(torch_walls)
        torch_s = median(torch_inside)
        note = f"samples {min(lite[state]) * 1e3:.1f}-{max(lite[state]) * 1e3:.1f} ms"
        if state == "cached":
            slow = ", ".join(f"{n} {t:.1f}" for n, t in list(breakdown["slowest_scopedlite_modules_ms"].items())[:3])  # type: ignore[union-attr]
            extra = ", ".join(breakdown["other_modules_loaded"])  # type: ignore[arg-type]
            note += f"; slowest own modules (self ms): {slow}; modules not already loaded by torch: {extra or 'none'}"
        else:
            note += "; goal judged on the cached row"
        rows.append(
            Measurement(
                key=f"import_{state}",
                title=f"{title}, {label}",
                unit="ms",
                value=ms,
                baseline=torch_s * 1e3,
                ratio=safe_ratio(torch_s + ms / 1e3, torch_s),
                goal=f"<= {GOAL_MS:.0f} ms" + ("" if state == "cached" else " (info)"),
                met=ms <= GOAL_MS if state == "cached" else None,
                method=method,
                value_label=f"+{ms:.1f} ms (process {wall_with:.2f} s)",
                baseline_label=f"import torch: {torch_s:.2f} s (process {wall_without:.2f} s)",
                goal_fraction=ms / GOAL_MS,
                note=note,
                raw={"lite_import_s": lite[state], "walls_s": walls[state], "torch_only_walls_s": torch_walls, "torch_import_s": torch_inside, **({"importtime": breakdown} if state == "cached" else {})},
            )
        )
    return rows
