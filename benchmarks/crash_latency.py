"""Measurement (c): how long from a rank failing to ``WorkerFailedError`` in the main process.

Three ways to fail (see ``scripts/crash.py``): rank 1 raises, or kills itself with SIGKILL,
while rank 0 waits in a collective; or rank 1 raises while rank 0 spins in pure Python
outside any collective (the case that needs the supervisor to interrupt the main thread).
Latency = ``time.time()`` when the main process caught the error minus ``time.time()``
written by rank 1 just before failing. Cases are interleaved and the median of the repeats
is reported. Each run also checks that the error names rank 1 and no child process is left.

The ``raise`` case has a baseline: the same failure under raw ``torchrun``
(``scripts/crash_torchrun.py``), from rank 1's stamp to the torchrun command's exit, which is
when its user sees the failure (the agent polls its workers, stops the others, then reports).
"""

from __future__ import annotations

import time

from common import (
    PYTHON,
    SCRIPTS_DIR,
    Measurement,
    bench_env,
    failed,
    free_port,
    log,
    median,
    read_json,
    run_child,
    temp_path,
)

GOAL_S = 1.0
CASES = {
    "raise": "rank 1 raises, rank 0 in lite.barrier()",
    "sigkill": "rank 1 SIGKILLs itself, rank 0 in lite.barrier()",
    "busy": "rank 1 raises, rank 0 busy in a pure-Python loop",
}
METHOD = (
    "2 CPU procs; rank 1 writes time.time() then fails; main process records time.time() in "
    "`except lite.WorkerFailedError`; difference, median of {n}"
)


def _run_case(case: str) -> tuple[float | None, dict[str, object], float, str]:
    """One run: (latency or None, what the main process reported, wall time, error text)."""
    stamp, out = temp_path(".txt"), temp_path()
    result = run_child([PYTHON, str(SCRIPTS_DIR / "crash.py"), case, str(stamp), str(out)], bench_env(), timeout=90)
    try:
        if not out.exists() or not stamp.exists():
            return None, {}, result.wall_s, result.describe()
        report = read_json(out)
        failed_at = float(stamp.read_text())
        caught = report.get("caught")
        if caught is None:
            return None, report, result.wall_s, "the main process did not catch lite.WorkerFailedError"
        return float(caught) - failed_at, report, result.wall_s, ""
    finally:
        stamp.unlink(missing_ok=True)
        out.unlink(missing_ok=True)


def _run_torchrun() -> float | None:
    """The baseline of the ``raise`` case: rank 1's stamp to the torchrun command's exit."""
    stamp = temp_path(".txt")
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    result = run_child([*command, str(SCRIPTS_DIR / "crash_torchrun.py"), str(stamp)], bench_env(), timeout=90)
    ended = time.time()
    try:
        if result.ok or not stamp.exists():  # it must fail, and rank 1 must have got that far
            log(
                f"  crash torchrun: no result ({result.describe().splitlines()[0] if not result.ok else 'it exited 0'})"
            )
            return None
        return ended - float(stamp.read_text())
    finally:
        stamp.unlink(missing_ok=True)


def measure(quick: bool) -> list[Measurement]:
    repeats = 2 if quick else 3
    method = METHOD.format(n=repeats)
    latencies: dict[str, list[float]] = {c: [] for c in CASES}
    problems: dict[str, list[str]] = {c: [] for c in CASES}
    walls: dict[str, list[float]] = {c: [] for c in CASES}
    torchrun: list[float] = []
    for repeat in range(repeats):
        baseline = _run_torchrun()
        if baseline is not None:
            torchrun.append(baseline)
            log(f"  crash raise under torchrun ({repeat + 1}/{repeats}): {baseline * 1e3:.0f} ms")
        for case in CASES:
            latency, report, wall, error = _run_case(case)
            walls[case].append(wall)
            if latency is None:
                problems[case].append(error.splitlines()[0] if error else "no result")
                log(f"  crash {case}: FAILED {error.splitlines()[0] if error else ''}")
                continue
            latencies[case].append(latency)
            if report.get("ranks") != [1]:
                problems[case].append(f"error named ranks {report.get('ranks')}, expected [1]")
            if report.get("leftover_children"):
                problems[case].append(f"child processes left behind: {report.get('leftover_children')}")
            log(f"  crash {case} ({repeat + 1}/{repeats}): {latency * 1e3:.0f} ms - {report.get('summary')}")

    rows = []
    for case, description in CASES.items():
        title = f"Crash-to-error latency: {description}"
        if not latencies[case]:
            rows.append(failed(f"crash_{case}", title, f"<= {GOAL_S:.0f} s", method, "; ".join(problems[case])))
            continue
        value = median(latencies[case])
        checks = "; ".join(sorted(set(problems[case]))) or "error named rank 1, no process left behind"
        base = median(torchrun) if case == "raise" and torchrun else None
        if base is not None:
            checks += f"; torchrun samples {', '.join(f'{v * 1e3:.0f}' for v in torchrun)} ms (to the command's exit)"
        rows.append(
            Measurement(
                key=f"crash_{case}",
                title=title,
                unit="s",
                value=value,
                baseline=base,
                ratio=value / base if base else None,
                goal=f"<= {GOAL_S:.0f} s",
                met=value <= GOAL_S and not problems[case],
                method=method,
                value_label=f"{value * 1e3:.0f} ms",
                baseline_label=f"{base * 1e3:.0f} ms (raw torchrun, to its exit)" if base else "-",
                goal_fraction=value / GOAL_S,
                note=f"samples {', '.join(f'{v * 1e3:.0f}' for v in latencies[case])} ms; {checks}",
                raw={
                    "latencies_s": latencies[case],
                    "walls_s": walls[case],
                    "problems": problems[case],
                    "torchrun_s": torchrun if case == "raise" else [],
                },
            )
        )
    return rows
