"""What the shape check in front of ``lite.all_reduce`` / ``lite.all_gather`` costs per call.

Outside ``lite.join`` each of them first exchanges one small int64 row describing the call on
every rank (one all-reduce of 128 int64; ``scopedlite/_comm/signature.py``), so shapes that
differ between ranks raise on every rank instead of aborting the process. This measures the
price side by side in one 2-process gloo launch (``scripts/collective_checks.py``): a 4-float
``lite.all_reduce`` against ``torch.distributed.all_reduce`` of the same tensor and against the
strategy's own reduction without the check, the same for ``all_gather``, and
``lite.gather_for_metrics`` of a (16, 4) batch against a raw all-gather. Reported, no goal: the
check is one more latency-bound collective per call, so on a small tensor it about doubles the
call; on a gradient-sized tensor it is lost in the transfer.
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
    quantile,
    read_json,
    run_child,
    temp_path,
)

METHOD = (
    "one 2-proc gloo launch; {calls} rounds of one call of each mode, order rotating; rank 0 "
    "perf_counter per call; ratio of the medians, the fastest decile's ratio in the note"
)
ROWS = (
    (
        "collective_check_all_reduce",
        "lite.all_reduce (shape check + reduce) vs dist.all_reduce, 4 floats",
        "lite_all_reduce",
        "raw_all_reduce",
        "unchecked_all_reduce",
    ),
    (
        "collective_check_all_gather",
        "lite.all_gather (shape check + gather) vs dist.all_gather, 4 floats",
        "lite_all_gather",
        "raw_all_gather",
        None,
    ),
    (
        "collective_gather_for_metrics",
        "lite.gather_for_metrics of (16, 4) vs dist.all_gather of 4 floats",
        "lite_gather_for_metrics",
        "raw_all_gather",
        None,
    ),
)


def measure(quick: bool) -> list[Measurement]:
    calls = 400 if quick else 2000
    method = METHOD.format(calls=calls)
    out = temp_path()
    result = run_child(
        [PYTHON, str(SCRIPTS_DIR / "collective_checks.py"), str(out), str(calls)], bench_env(), timeout=300
    )
    if not result.ok or not out.exists():
        return [failed(key, title, "- (reported)", method, result.describe()) for key, title, *_ in ROWS]
    data = read_json(out)
    out.unlink()
    rows = []
    for key, title, mode, baseline, unchecked in ROWS:
        value, base = median(data[mode]), median(data[baseline])
        fast = quantile(data[mode], 0.1) / quantile(data[baseline], 0.1)
        note = (
            f"fastest decile: {quantile(data[mode], 0.1) * 1e6:.0f} us "
            f"vs {quantile(data[baseline], 0.1) * 1e6:.0f} us ({fast:.2f} x)"
        )
        if unchecked is not None:
            plain = median(data[unchecked])
            note += (
                f"; the strategy's reduction without the check {plain * 1e6:.0f} us, so the check adds "
                f"{(value - plain) * 1e6:.0f} us per call ({(value - plain) / base:.2f} x a raw all_reduce)"
            )
        log(f"{key}: {value * 1e6:.0f} us vs {base * 1e6:.0f} us; {note}")
        rows.append(
            Measurement(
                key=key,
                title=title,
                unit="us",
                value=value * 1e6,
                baseline=base * 1e6,
                ratio=value / base,
                goal="- (reported)",
                met=None,
                method=method,
                value_label=f"{value * 1e6:.0f} us ({mode})",
                baseline_label=f"{base * 1e6:.0f} us ({baseline})",
                note=note,
                raw={"median_s": {m: median(v) for m, v in data.items()}, "wall_s": result.wall_s},
            )
        )
    return rows
