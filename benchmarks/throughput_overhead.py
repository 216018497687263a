"""What ``lite.throughput`` costs a training step (``scripts/throughput_steps.py``).

Per-step time of the shared DDP workload without a meter, with ``lite.throughput(window=10)``
(its default: one all-gather of 10 float64 per rank per window) and with ``window=1`` (an
exchange at every step, what steps inside ``lite.join``'s rounds pay), modes rotating in one
launch. Goal: window 10 / off <= 1.01.
"""

from __future__ import annotations

from common import PYTHON, SCRIPTS_DIR, Measurement, StepModes, bench_env, failed, log, read_json, run_child, temp_path

WARMUP = 5
STEPS = 60
GOAL = 1.01
METHOD = (
    f"one launch, blocks of {WARMUP}+{STEPS} steps (MLP 3x512, batch 64, 2 CPU procs, ddp) without a meter, "
    "with lite.throughput(window=10) and window=1, rotating; rank 0 perf_counter per step; ratio of pooled medians"
)


def measure(quick: bool) -> list[Measurement]:
    blocks = 2 if quick else 4
    key, title = "throughput_step", "lite.throughput: per-step time, window 10 vs no meter"
    out = temp_path()
    command = [PYTHON, str(SCRIPTS_DIR / "throughput_steps.py"), str(out), str(WARMUP), str(STEPS), str(blocks)]
    result = run_child(command, bench_env(), timeout=600)
    if not result.ok or not out.exists():
        return [failed(key, title, f"<= {GOAL} x off", METHOD, result.describe())]
    modes = StepModes.of(read_json(out))
    out.unlink()
    off, window10, window1 = (modes.pooled(mode) for mode in ("off", "window10", "window1"))
    log(f"throughput: off {off * 1e3:.2f} ms, window 10 {window10 * 1e3:.2f} ms, window 1 {window1 * 1e3:.2f} ms")
    row = modes.measurement(key, title, "window10", "off", GOAL, METHOD, ("window 10", "no meter"))
    row.note += (
        f"; window 1 (an exchange every step, as inside join's rounds) / off {modes.ratio('window1', 'off'):.3f} "
        f"({(window1 - off) * 1e6:.0f} us per exchange)"
    )
    row.raw["wall_s"] = result.wall_s
    return [row]
