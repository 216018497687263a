"""What ``lite.throughput`` costs a training step (``scripts/throughput_steps.py``).

Per-step time of the shared DDP workload without a meter, with ``lite.throughput(window=10)``
(its default: one all-gather of 10 float64 per rank per window) and with ``window=1`` (an
exchange at every step, what steps inside ``lite.join``'s rounds pay), modes rotating in one
launch. Goal: window 10 / off <= 1.01.
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
    data = read_json(out)
    out.unlink()
    pooled = {name: median([t for b in blocks_ for t in b]) for name, blocks_ in data["steps"].items()}
    per_block = [median(w) / median(o) for w, o in zip(data["steps"]["window10"], data["steps"]["off"])]
    ratio = safe_ratio(pooled["window10"], pooled["off"])
    every = safe_ratio(pooled["window1"], pooled["off"])
    cpu = {name: median([t for b in blocks_ for t in b]) for name, blocks_ in data["cpu"].items()}
    cpu_ratio = safe_ratio(cpu["window10"], cpu["off"])
    log(
        f"throughput: off {pooled['off'] * 1e3:.2f} ms, window 10 {pooled['window10'] * 1e3:.2f} ms, "
        f"window 1 {pooled['window1'] * 1e3:.2f} ms"
    )
    return [
        Measurement(
            key=key,
            title=title,
            unit="ms",
            value=pooled["window10"] * 1e3,
            baseline=pooled["off"] * 1e3,
            ratio=ratio,
            goal=f"<= {GOAL} x off",
            goal_ratio=GOAL,
            met=ratio is not None and ratio <= GOAL,
            verdict=noise_verdict(ratio is not None and ratio <= GOAL, per_block, GOAL),
            method=METHOD,
            value_label=f"{pooled['window10'] * 1e3:.2f} ms (window 10)",
            baseline_label=f"{pooled['off'] * 1e3:.2f} ms (no meter)",
            note=(
                f"per-block ratios {', '.join(f'{r:.3f}' for r in per_block)}; CPU time per step (process_time) "
                f"window 10 / off {cpu_ratio:.3f}; window 1 (an exchange every step, as inside join's rounds) / off "
                f"{every:.3f} ({(pooled['window1'] - pooled['off']) * 1e6:.0f} us per exchange)"
            ),
            raw={"steps_s": data["steps"], "cpu_s": data["cpu"], "wall_s": result.wall_s},
        )
    ]
