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
    StepModes,
    bench_env,
    failed,
    log,
    median,
    read_json,
    run_child,
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
    modes = StepModes.of(data)
    look = median(data["look_s"])
    log(
        f"watchdog: off {modes.pooled('off') * 1e3:.2f} ms, default {modes.pooled('default') * 1e3:.2f} ms, "
        f"eager {modes.pooled('eager') * 1e3:.2f} ms; one look {look * 1e6:.0f} us"
    )
    row = modes.measurement(key, title, "default", "off", GOAL, METHOD, ("watchdog on", "off"))
    row.note += (
        f"; eager (a look every 50 ms) / off {modes.ratio('eager', 'off'):.3f}; one look (stack, episode, store "
        f"write, rank 0's reads) {look * 1e6:.0f} us median, i.e. {look / 2.0:.1e} of a core at the default interval"
    )
    row.raw.update(look_s=data["look_s"], wall_s=result.wall_s)
    return [row]
