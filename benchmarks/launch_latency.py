"""Measurement: launch latency, from starting the command to the first line inside the region.

``scripts/launch_first_line.py`` is started three ways, 2 CPU processes each: under scopedlite's
script launcher (``lite.launch(strategy="ddp")``: rank 1 re-executes the script), its fork
launcher (``strategy="ddp_fork"``), and as a plain ``torch.distributed`` script under
``python -m torch.distributed.run --nproc-per-node 2`` (first line after
``init_process_group``). The driver records ``time.time()`` just before spawning; every rank
writes ``time.time()`` at its first line. The figure is the time until the *last* rank got
there (the region cannot do anything collective before), median over runs that alternate
between the three ways; rank 0's own latency is in the note.
"""

from __future__ import annotations

import time

from common import (
    PYTHON,
    SCRIPTS_DIR,
    Measurement,
    failed,
    free_port,
    installed_env,
    log,
    median,
    run_child,
    safe_ratio,
    temp_path,
)

MODES = {
    "script": "script launcher (re-executes the script)",
    "fork": "fork launcher (ddp_fork)",
    "torchrun": "python -m torch.distributed.run --nproc-per-node 2",
}
METHOD = (
    "2 CPU procs, OMP_NUM_THREADS=1; driver time.time() before spawn -> time.time() at the first line "
    "inside `with lite.launch(...)` (torchrun: after init_process_group) on the last rank to get there; "
    "median of {n}, modes alternating"
)


def _run(mode: str) -> tuple[list[float] | None, str]:
    """One run: latency of each rank (seconds), or None and the reason."""
    out = temp_path(".txt")
    cmd = [PYTHON]
    if mode == "torchrun":
        cmd += [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
        ]
    cmd += [str(SCRIPTS_DIR / "launch_first_line.py"), mode, str(out)]
    started = time.time()
    result = run_child(cmd, installed_env(), timeout=90)
    stamps = [out.with_name(f"{out.name}.{rank}") for rank in range(2)]
    try:
        if not result.ok or not all(p.exists() for p in stamps):
            return None, result.describe()
        return [float(p.read_text()) - started for p in stamps], ""
    finally:
        for p in stamps:
            p.unlink(missing_ok=True)


def measure(quick: bool) -> list[Measurement]:
    repeats = 3 if quick else 5
    method = METHOD.format(n=repeats)
    last: dict[str, list[float]] = {m: [] for m in MODES}
    rank0: dict[str, list[float]] = {m: [] for m in MODES}
    problems: dict[str, list[str]] = {m: [] for m in MODES}
    for repeat in range(repeats):
        for mode in MODES:
            latencies, error = _run(mode)
            if latencies is None:
                problems[mode].append(error.splitlines()[0] if error else "no result")
                log(f"  launch {mode}: FAILED {error}")
                continue
            last[mode].append(max(latencies))
            rank0[mode].append(latencies[0])
            log(
                f"  launch {mode} ({repeat + 1}/{repeats}): "
                + ", ".join(f"rank {r} {v:.2f} s" for r, v in enumerate(latencies))
            )

    if not last["torchrun"]:
        base = None
    else:
        base = median(last["torchrun"])
    rows = []
    for mode in ("script", "fork"):
        title = f"Launch latency to the first line on every rank: {MODES[mode]} vs torchrun"
        if not last[mode]:
            rows.append(failed(f"launch_{mode}", title, "- (reported)", method, "; ".join(problems[mode])))
            continue
        value = median(last[mode])
        note = (
            f"last rank samples {', '.join(f'{v:.2f}' for v in last[mode])} s; "
            f"rank 0 median {median(rank0[mode]):.2f} s; "
            f"torchrun samples {', '.join(f'{v:.2f}' for v in last['torchrun'])} s"
            + (f", rank 0 median {median(rank0['torchrun']):.2f} s" if rank0["torchrun"] else "")
            + (
                f"; problems: {'; '.join(problems[mode] + problems['torchrun'])}"
                if problems[mode] or problems["torchrun"]
                else ""
            )
        )
        rows.append(
            Measurement(
                key=f"launch_{mode}",
                title=title,
                unit="s",
                value=value,
                baseline=base,
                ratio=safe_ratio(value, base),
                goal="- (reported)",
                met=None,
                method=method,
                value_label=f"{value:.2f} s",
                baseline_label="torchrun failed" if base is None else f"{base:.2f} s (torchrun)",
                note=note,
                raw={
                    "last_rank_s": last[mode],
                    "rank0_s": rank0[mode],
                    "torchrun_last_rank_s": last["torchrun"],
                    "torchrun_rank0_s": rank0["torchrun"],
                    "problems": problems,
                },
            )
        )
    return rows
