"""Measurement: how long a save stalls the training loop, ``blocking=False`` vs blocking (issue 39).

``scripts/save_stall.py`` saves a 201 MB model (12 x ``Linear(2048, 2048)``, float32) on
2 CPU ranks, one launch per strategy (ddp: rank 0 writes one file; fsdp: every rank writes its
shards through ``torch.distributed.checkpoint``), rounds of one blocking and one background
save in alternating order. The stall is the time the training thread spends in ``lite.save``
(for a background save, plus the wait once the write is done, where the ranks agree it is
complete). Goal: background / blocking <= 0.10. The note has the floor of that stall (a plain
copy of rank 0's tensors into buffers allocated before), the first background call (its CPU
buffers allocated then, reused by the later ones) and the step time while a write runs beside
training.
"""

from __future__ import annotations

import shutil

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
    temp_path,
)

GOAL = 0.10
STRATEGIES = ("ddp", "fsdp")
METHOD = (
    "one 2-proc launch per strategy (gloo, 1 thread per process): a 201 MB model (12 x Linear(2048, 2048), "
    "float32; the model and a step count) saved to /tmp in rounds of one blocking and one background "
    "lite.save, order alternating, "
    "after one untimed save of each kind; rank 0 perf_counter in lite.save (background: + the wait once "
    "written); ddp trains its last layer between saves, fsdp polls every 50 ms (its step would all-gather "
    "the model); ratio of medians"
)


def measure(quick: bool) -> list[Measurement]:
    rounds = 3 if quick else 6
    return [_one(strategy, rounds) for strategy in STRATEGIES]


def _one(strategy: str, rounds: int) -> Measurement:
    key, title = (
        f"save_stall_{strategy}",
        f"lite.save of a 201 MB model under {strategy} (2 ranks): training stall, blocking=False vs blocking",
    )
    goal = f"<= {GOAL} x blocking"
    out, folder = temp_path(), temp_path("")
    folder.mkdir()
    command = [PYTHON, str(SCRIPTS_DIR / "save_stall.py"), str(out), str(folder), strategy, str(rounds)]
    result = run_child(command, bench_env(), timeout=600)
    shutil.rmtree(folder, ignore_errors=True)
    if not result.ok or not out.exists():
        return failed(key, title, goal, METHOD, result.describe())
    data = read_json(out)
    out.unlink()
    blocking, background = median(data["blocking"]), median(data["background"])
    ratio = background / blocking
    per_round = [b / a for a, b in zip(data["blocking"], data["background"])]
    plain, writing = median(data["plain_steps"]), median(data["writing_steps"])
    log(f"save stall {strategy}: blocking {blocking * 1e3:.0f} ms, background {background * 1e3:.0f} ms ({ratio:.3f})")
    return Measurement(
        key=key,
        title=title,
        unit="ms",
        value=background * 1e3,
        baseline=blocking * 1e3,
        ratio=ratio,
        goal=goal,
        goal_ratio=GOAL,
        met=ratio <= GOAL,
        verdict=noise_verdict(ratio <= GOAL, per_round, GOAL),
        method=METHOD,
        value_label=f"{background * 1e3:.0f} ms (blocking=False)",
        baseline_label=f"{blocking * 1e3:.0f} ms (blocking)",
        note=(
            f"per-round ratios {', '.join(f'{r:.3f}' for r in per_round)}; a plain copy of rank 0's tensors into "
            f"buffers allocated before (the floor) {median(data['copy_floor']) * 1e3:.0f} ms; "
            f"the first background call (buffers "
            f"allocated) {data['first_background'] * 1e3:.0f} ms; of a background stall, the wait after the write "
            f"{median(data['wait']) * 1e3:.1f} ms; loop step while a write runs {writing * 1e3:.0f} ms vs "
            f"{plain * 1e3:.0f} ms without ({len(data['writing_steps'])} steps over {rounds} writes; 2 shared cores: "
            "the writer competes with training)"
        ),
        raw={**data, "wall_s": result.wall_s},
    )
