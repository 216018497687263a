"""Measurement (b): what ``import scopedlite`` costs on top of ``import torch``.

Every sample is a fresh interpreter. The headline number is measured inside the child with
``perf_counter`` around ``import scopedlite`` *after* ``import torch`` (so torch's 1-2 s, and
its noise, are not part of it); the whole-process wall time of ``import torch`` alone is
reported beside it. In the same child, every public name is then resolved
(``getattr(scopedlite, name)`` for ``__all__``): the package loads its modules lazily
(PEP 562), so that second figure is what a script pays by its first ``lite.launch``.

Two bytecode states are measured, because they differ by a factor of about three:

- cached: a copy of the package with its ``.pyc`` files compiled (what ``pip install``
  leaves, and what any normal interpreter writes on first import);
- uncached: a copy without ``.pyc`` and ``PYTHONDONTWRITEBYTECODE=1``, so every module is
  compiled from source at every start (this environment sets that variable).

Copies on ``PYTHONPATH`` are used so that neither state writes into the source tree. The goal
is judged on the plain import, cached; the other rows are for information.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import PYTHON, Measurement, bench_env, copy_package, failed, log, median, run_child, safe_ratio

GOAL_MS = 30.0
TORCH_ONLY = (
    "import time, json; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "print(json.dumps({'torch_s': t1 - t0}))"
)
# The child also times the full (generation 2) garbage collections that run while it imports:
# after `import torch` the first one walks all of torch's objects, and whichever code allocates
# enough next pays it (here, our import; in any program, its next few thousand objects).
WITH_LITE = (
    "import time, json, gc; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "full = []; gc.callbacks.append(lambda phase, info: info['generation'] == 2 and full.append(time.perf_counter())); "
    "import scopedlite; t2 = time.perf_counter(); "
    "[getattr(scopedlite, name) for name in scopedlite.__all__]; t3 = time.perf_counter(); "
    "gc.callbacks.clear(); "
    "print(json.dumps({'torch_s': t1 - t0, 'import_s': t2 - t1, 'api_s': t3 - t1, "
    "'full_gc_s': sum(full[1::2]) - sum(full[0::2]), "
    "'file': scopedlite.__file__}))"
)
BREAKDOWN = "import torch; import scopedlite; [getattr(scopedlite, name) for name in scopedlite.__all__]"
METHOD = (
    "fresh interpreters: perf_counter around {what} after `import torch`, median of {n}; baseline "
    "= perf_counter around `import torch` alone (process wall in brackets); ratio = (torch + scopedlite) / torch"
)


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
    """``-X importtime`` of one cached import plus API resolution: scopedlite's slowest
    modules, and the modules outside scopedlite that it loads although torch had not."""
    result = run_child([PYTHON, "-X", "importtime", "-c", BREAKDOWN], env, timeout=60, cwd=cwd)
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
    with tempfile.TemporaryDirectory(prefix="scopedlite-import-") as tmp:
        cached_dir, uncached_dir = Path(tmp) / "cached", Path(tmp) / "uncached"
        copy_package(cached_dir, compiled=True)
        copy_package(uncached_dir, compiled=False)
        envs = {
            "cached": bench_env(PYTHONPATH=str(cached_dir)),
            "uncached": bench_env(PYTHONPATH=str(uncached_dir), PYTHONDONTWRITEBYTECODE="1"),
        }
        torch_walls: list[float] = []
        torch_inside: list[float] = []
        samples: dict[str, dict[str, list[float]]] = {
            s: {"import_s": [], "api_s": [], "wall_s": [], "full_gc_s": []} for s in envs
        }
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
                        samples[which]["import_s"].append(data["import_s"])
                        samples[which]["api_s"].append(data["api_s"])
                        samples[which]["wall_s"].append(wall)
                        samples[which]["full_gc_s"].append(data["full_gc_s"])
            breakdown = _breakdown(envs["cached"], Path(tmp))
        except RuntimeError as e:
            return [
                failed(
                    "import_time",
                    "import scopedlite after import torch",
                    f"<= {GOAL_MS:.0f} ms",
                    METHOD.format(what="`import scopedlite`", n=runs),
                    str(e),
                )
            ]

    torch_s = median(torch_inside)
    torch_label = f"import torch: {torch_s:.2f} s (process {median(torch_walls):.2f} s)"
    slow = ", ".join(f"{n} {t:.1f}" for n, t in list(breakdown["slowest_scopedlite_modules_ms"].items())[:3])  # type: ignore[union-attr]
    extra = ", ".join(breakdown["other_modules_loaded"]) or "none"  # type: ignore[arg-type]
    specs = [
        (
            "import_cached",
            "cached",
            "import_s",
            "import scopedlite after import torch (.pyc cached, as pip installs it)",
            "`import scopedlite`",
            True,
        ),
        (
            "import_api_cached",
            "cached",
            "api_s",
            "import scopedlite + resolve every public name (.pyc cached)",
            "`import scopedlite` + getattr of all `__all__`",
            False,
        ),
        (
            "import_api_uncached",
            "uncached",
            "api_s",
            "import scopedlite + resolve every public name, no .pyc (PYTHONDONTWRITEBYTECODE=1, as here)",
            "`import scopedlite` + getattr of all `__all__`",
            False,
        ),
    ]
    rows = []
    for key, state, field, title, what, judged in specs:
        values = samples[state][field]
        ms = median(values) * 1e3
        note = (
            f"samples {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f} ms; "
            f"process wall with scopedlite {median(samples[state]['wall_s']):.2f} s"
        )
        if field == "api_s":
            note += (
                f"; of which full garbage collections (the first after `import torch` walks all of torch's objects; "
                f"any program pays it at its next few thousand allocations) "
                f"median {median(samples[state]['full_gc_s']) * 1e3:.1f} ms"
            )
        if key == "import_api_cached":
            note += f"; slowest own modules (-X importtime self ms): {slow}; modules loaded that torch had not: {extra}"
        log(f"import: {title}: +{ms:.1f} ms")
        rows.append(
            Measurement(
                key=key,
                title=title,
                unit="ms",
                value=ms,
                baseline=torch_s * 1e3,
                ratio=safe_ratio(torch_s + ms / 1e3, torch_s),
                goal=f"<= {GOAL_MS:.0f} ms" + ("" if judged else " (info)"),
                met=ms <= GOAL_MS if judged else None,
                verdict="" if judged else f"- (info: {'under' if ms <= GOAL_MS else 'over'} 30 ms)",
                method=METHOD.format(what=what, n=runs),
                value_label=f"+{ms:.1f} ms",
                baseline_label=torch_label,
                goal_fraction=ms / GOAL_MS,
                note=note,
                raw={
                    **samples[state],
                    "torch_import_s": torch_inside,
                    "torch_only_walls_s": torch_walls,
                    **({"importtime": breakdown} if key == "import_api_cached" else {}),
                },
            )
        )
    return rows
