"""Measurement: what the same-path check costs ``lite.save`` and ``lite.load`` (issue 36).

Every rank must name the same checkpoint, so ``lite.save`` and ``lite.load`` first compare
the ranks' paths: one all-reduce of two int64s (a digest of the path and its negation,
reduced by max). ``scripts/save_paths.py`` times it per call beside ``lite.barrier()`` and a
small ``lite.save`` with and without it, in one 2-process launch, the modes rotating per
block. Reported, no goal: the check is paid once per save or load, next to a file write.
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
    read_json,
    run_child,
    spread,
    temp_path,
)

CALLS = 50
METHOD = (
    f"one 2-proc ddp launch (gloo); blocks of {CALLS} calls per mode, modes rotating: the check alone, "
    "lite.barrier(), lite.save of Linear(64, 64) + SGD with and without the check; rank 0 "
    "perf_counter per call; median of the pooled calls"
)


def measure(quick: bool) -> list[Measurement]:
    blocks = 2 if quick else 4
    title = "Same-path check of lite.save / lite.load: per call"
    out = temp_path()
    folder = temp_path("")
    folder.mkdir()
    command = [PYTHON, str(SCRIPTS_DIR / "save_paths.py"), str(out), str(folder), str(CALLS), str(blocks)]
    result = run_child(command, bench_env(), timeout=240)
    shutil.rmtree(folder, ignore_errors=True)
    if not result.ok or not out.exists():
        return [failed("checkpoint_path_check", title, "- (reported)", METHOD, result.describe())]
    data = read_json(out)
    out.unlink()
    pooled = {mode: median([t for block in times for t in block]) for mode, times in data.items()}
    per_block = {mode: [median(block) for block in times] for mode, times in data.items()}
    check, barrier = pooled["check"], pooled["barrier"]
    save, bare = pooled["save"], pooled["save_without_check"]
    log(
        f"path check {check * 1e3:.3f} ms, barrier {barrier * 1e3:.3f} ms; "
        f"save {save * 1e3:.2f} ms vs {bare * 1e3:.2f} ms"
    )
    raw = {"per_block_median_s": per_block, "wall_s": result.wall_s}
    return [
        Measurement(
            key="checkpoint_path_check",
            title=title + ", vs lite.barrier()",
            unit="ms",
            value=check * 1e3,
            baseline=barrier * 1e3,
            ratio=check / barrier,
            goal="- (reported)",
            met=None,
            method=METHOD,
            value_label=f"{check * 1e3:.3f} ms (check)",
            baseline_label=f"{barrier * 1e3:.3f} ms (barrier)",
            note=f"spread of the check's block medians {spread(per_block['check']):.1%}",
            raw=raw,
        ),
        Measurement(
            key="checkpoint_save_with_path_check",
            title="lite.save of Linear(64, 64) + SGD (2 ranks): with the check vs without",
            unit="ms",
            value=save * 1e3,
            baseline=bare * 1e3,
            ratio=save / bare,
            goal="- (reported)",
            met=None,
            method=METHOD,
            value_label=f"{save * 1e3:.2f} ms (with)",
            baseline_label=f"{bare * 1e3:.2f} ms (without)",
            note=(
                "per-block ratios "
                + ", ".join(f"{a / b:.3f}" for a, b in zip(per_block["save"], per_block["save_without_check"]))
            ),
            raw=raw,
        ),
    ]
