"""What comparing the optimizers' steps at each backward costs an FSDP step (``scripts/stepped_steps.py``).

Under fsdp and model_parallel a ``lite.backward`` that reduces gradients posts the digest of
the steps the optimizers took since the previous one (an LR scheduler stepped on some ranks
only is refused there, ``_strategies/stepped.py``) in one all-reduce of two int64, and reads it
after the backward. Per-step time of the shared workload under fsdp with the comparison and
without it, alternating in one launch. Goal: compared / off <= 1.02.
"""

from __future__ import annotations

from common import PYTHON, SCRIPTS_DIR, Measurement, StepModes, bench_env, failed, log, read_json, run_child, temp_path

WARMUP = 5
STEPS = 60
GOAL = 1.02
METHOD = (
    f"one launch, blocks of {WARMUP}+{STEPS} steps (MLP 3x512, batch 64, 2 CPU procs, fsdp) with the steps "
    "comparison at each lite.backward and without it, alternating; rank 0 perf_counter per step; "
    "ratio of pooled medians"
)


def measure(quick: bool) -> list[Measurement]:
    blocks = 4 if quick else 10
    key, title = "stepped_compare", "fsdp: per-step time, optimizers' steps compared at each backward vs not"
    out = temp_path()
    command = [PYTHON, str(SCRIPTS_DIR / "stepped_steps.py"), str(out), str(WARMUP), str(STEPS), str(blocks)]
    result = run_child(command, bench_env(), timeout=600)
    if not result.ok or not out.exists():
        return [failed(key, title, f"<= {GOAL} x off", METHOD, result.describe())]
    modes = StepModes.of(read_json(out))
    out.unlink()
    log(f"stepped: compared {modes.pooled('compared') * 1e3:.2f} ms, off {modes.pooled('off') * 1e3:.2f} ms")
    row = modes.measurement(key, title, "compared", "off", GOAL, METHOD, ("compared", "not compared"))
    row.note += f"; {(modes.pooled('compared') - modes.pooled('off')) * 1e6:.0f} us per step"
    row.raw["wall_s"] = result.wall_s
    return [row]
