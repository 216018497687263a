"""What the hang watchdog costs (``scripts/watchdog_steps.py``).

Per-step time of the shared DDP workload with the watchdog off, at its default (a look every
2 s) and eager (a look every 50 ms), launch blocks rotating; and the cost of one look, timed
directly on rank 0. Goal: default / off <= 1.01 (nothing measurable: one look every 2 s).
"""

from __future__ import annotations

from common import (
    PYTHON,
    SCRIPTS_DIR,
    Measurement,
    bench_env,
    failed,
    log,
    median,
    noise_verdict,
    read_json,
    run_child,
    safe_ratio,
    temp_path,
)

WARMUP = 5
STEPS = 60
GOAL = 1.01
METHOD = (
    f"launch blocks of {WARMUP}+{STEPS} steps (MLP 3x512, batch 64, 2 CPU procs, ddp) with the "
    "watchdog off, default (a look every 2 s) and eager (every 50 ms), rotating; rank 0 "
    "perf_counter per step; ratio of pooled medians; one look timed 200 times on rank 0"
)


def measure(quick: bool) -> list[Measurement]:
    blocks = 2 if quick else 4
    key, title = "watchdog_step", "Hang watchdog: per-step time, default vs off"
    out = temp_path()
    command = [PYTHON, str(SCRIPTS_DIR / "watchdog_steps.py"), str(out), str(WARMUP), str(STEPS), str(blocks)]
    result = run_child(command, bench_env(), timeout=600)
    if not result.ok or not out.exists():
        return [failed(key, title, f"<= {GOAL} x off", METHOD, result.describe())]
    data = read_json(out)
    out.unlink()
    pooled = {name: median([t for b in blocks_ for t in b]) for name, blocks_ in data["steps"].items()}
    per_block = [median(d) / median(o) for d, o in zip(data["steps"]["default"], data["steps"]["off"])]
    ratio = safe_ratio(pooled["default"], pooled["off"])
    look = median(data["look_s"])
    eager = safe_ratio(pooled["eager"], pooled["off"])
    cpu = {name: median([t for b in blocks_ for t in b]) for name, blocks_ in data["cpu"].items()}
    cpu_ratio = safe_ratio(cpu["default"], cpu["off"])
    log(
        f"watchdog: off {pooled['off'] * 1e3:.2f} ms, default {pooled['default'] * 1e3:.2f} ms, "
        f"eager {pooled['eager'] * 1e3:.2f} ms; one look {look * 1e6:.0f} us"
    )
    return [
        Measurement(
            key=key,
            title=title,
            unit="ms",
            value=pooled["default"] * 1e3,
            baseline=pooled["off"] * 1e3,
            ratio=ratio,
            goal=f"<= {GOAL} x off",
            goal_ratio=GOAL,
            met=ratio is not None and ratio <= GOAL,
            verdict=noise_verdict(ratio is not None and ratio <= GOAL, per_block, GOAL),
            method=METHOD,
            value_label=f"{pooled['default'] * 1e3:.2f} ms (watchdog on)",
            baseline_label=f"{pooled['off'] * 1e3:.2f} ms (off)",
            note=(
                f"per-block ratios {', '.join(f'{r:.3f}' for r in per_block)}; CPU time per step (process_time, "
                f"less disturbed by other jobs) default / off {cpu_ratio:.3f}; eager (a look every 50 ms) / off "
                f"{eager:.3f}; one look (stack, episode, store write, rank 0's reads) {look * 1e6:.0f} us median, "
                f"i.e. {look / 2.0:.1e} of a core at the default interval"
            ),
            raw={"steps_s": data["steps"], "cpu_s": data["cpu"], "look_s": data["look_s"], "wall_s": result.wall_s},
        )
    ]
