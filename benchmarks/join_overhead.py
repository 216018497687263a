"""Measurement (d): what ``lite.join`` costs.

(i) Even data, where join has nothing to do: per-step time with and without
``with lite.join(model):``, in one launch, blocks rotating (see ``scripts/join_even.py``),
with torch's bare ``Join([model])`` as a reference for what join mode costs in torch itself.
The goal is "within noise": every block runs all modes back to back, and the per-block
ratios join/plain must not all fall on one side of 1 (a sign test; drift cancels per block).

(ii) Uneven shards: epoch wall time of ``lite.join`` (every sample once, ranks finish at
different steps) against the padded sampler outside join (every rank gets the same count by
repeating samples), plus torch's bare ``Join`` over the same shards as a reference.
"""

from __future__ import annotations

from common import PYTHON, SCRIPTS_DIR, Measurement, bench_env, failed, log, median, read_json, run_child, safe_ratio, spread, temp_path

EVEN_WARMUP = 5
EVEN_STEPS = 60
UNEVEN_SAMPLES = 1000
UNEVEN_BATCH = 1
UNEVEN_RANKS = 3
EVEN_METHOD = (
    f"one 2-proc launch; blocks of {EVEN_WARMUP}+{EVEN_STEPS} steps (MLP 3x512, batch 64) without "
    "join, in lite.join, in torch Join, rotating; rank 0 perf_counter per step, warm-up excluded; "
    "ratio of pooled medians; within noise if the per-block ratios fall on both sides of 1"
)
UNEVEN_METHOD = (
    f"{UNEVEN_SAMPLES} samples on {UNEVEN_RANKS} CPU procs, batch {UNEVEN_BATCH}, one launch, modes "
    "rotating per epoch; epoch timed on rank 0 between two barriers; median over epochs"
)


def _even(quick: bool, strategy: str = "ddp") -> list[Measurement]:
    blocks = 3 if quick else 6
    key = "join_even" if strategy == "ddp" else f"join_even_{strategy}"
    title = "Join on even data: per-step time, lite.join vs no join" + ("" if strategy == "ddp" else f" ({strategy})")
    out = temp_path()
    command = [PYTHON, str(SCRIPTS_DIR / "join_even.py"), str(out), str(EVEN_WARMUP), str(EVEN_STEPS), str(blocks), strategy]
    result = run_child(command, bench_env(), timeout=300)
    if not result.ok or not out.exists():
        return [failed(key, title, "within noise", EVEN_METHOD, result.describe())]
    data = read_json(out)
    out.unlink()
    plain_blocks = [median(b) for b in data["plain"]]
    join_blocks = [median(b) for b in data["join"]]
    plain = median([t for b in data["plain"] for t in b])
    joined = median([t for b in data["join"] for t in b])
    torch_samples = [t for b in data["torch_join"] for t in b]
    torch_joined = median(torch_samples) if torch_samples else None
    ratio = safe_ratio(joined, plain)
    assert ratio is not None
    # Each block ran all modes back to back, so per-block ratios cancel slow drift. Join is
    # "within noise" when those ratios do not all fall on one side of 1 (a sign test).
    block_ratios = [j / p for j, p in zip(join_blocks, plain_blocks)]
    within_noise = min(block_ratios) <= 1.0 <= max(block_ratios)
    noise = spread(plain_blocks)
    reference = f"torch's own Join([model]) (reference): {torch_joined * 1e3:.2f} ms/step" if torch_joined else (
        "torch's Join has no sharded counterpart; extra collectives per step inside lite.join: one "
        "312-byte all-reduce before each forward and each backward" + (", and each optimizer step" if strategy.startswith("deepspeed") else "")
    )
    log(f"join even ({strategy}): plain {plain * 1e3:.2f} ms, join {joined * 1e3:.2f} ms; {reference}")
    return [
        Measurement(
            key=key,
            title=title,
            unit="ms",
            value=joined * 1e3,
            baseline=plain * 1e3,
            ratio=ratio,
            goal="within noise (per-block ratios span 1.0)",
            goal_ratio=1.0,
            met=within_noise,
            method=EVEN_METHOD,
            value_label=f"{joined * 1e3:.2f} ms (join)",
            baseline_label=f"{plain * 1e3:.2f} ms (no join)",
            note=(
                f"per-block ratios {', '.join(f'{r:.3f}' for r in block_ratios)}; spread of no-join "
                f"blocks {noise:.1%}; {reference}"
            ),
            raw={
                "plain_block_medians_s": plain_blocks,
                "join_block_medians_s": join_blocks,
                "torch_join_step_s": torch_joined,
                "block_ratios": block_ratios,
                "noise": noise,
                "wall_s": result.wall_s,
            },
        )
    ]


def _coverage(seen: list[list[int]]) -> str:
    """'334/333/333 batches, 1000 distinct, 0 repeated' for one mode."""
    flat = [i for rank in seen for i in rank]
    return f"{'/'.join(str(len(r)) for r in seen)} samples per rank, {len(set(flat))} distinct, {len(flat) - len(set(flat))} repeated"


def _uneven(quick: bool) -> list[Measurement]:
    epochs = 1 if quick else 2
    title = f"Join on uneven shards ({UNEVEN_SAMPLES} samples, {UNEVEN_RANKS} ranks, batch {UNEVEN_BATCH}): epoch time"
    out = temp_path()
    command = [PYTHON, str(SCRIPTS_DIR / "join_uneven.py"), str(out), str(UNEVEN_SAMPLES), str(UNEVEN_BATCH), str(epochs), str(UNEVEN_RANKS)]
    result = run_child(command, bench_env(), timeout=180)
    if not result.ok or not out.exists():
        return [failed("join_uneven", title, "-", UNEVEN_METHOD, result.describe())]
    data = read_json(out)
    out.unlink()
    epoch = {mode: median(times) for mode, times in data["epoch_s"].items()}
    coverage = {mode: _coverage(seen) for mode, seen in data["seen"].items()}
    log("join uneven: " + ", ".join(f"{m} {t:.2f} s" for m, t in epoch.items()))
    raw = {"epoch_s": data["epoch_s"], "coverage": coverage, "wall_s": result.wall_s}
    rows = []
    for baseline, label in (("padded", "padded sampler, no join"), ("torch_join", "torch Join over the same shards")):
        ratio = safe_ratio(epoch["join"], epoch[baseline])
        rows.append(
            Measurement(
                key=f"join_uneven_vs_{baseline}",
                title=f"{title}: lite.join vs {label}",
                unit="s",
                value=epoch["join"],
                baseline=epoch[baseline],
                ratio=ratio,
                goal="- (reported)",
                met=None,
                method=UNEVEN_METHOD,
                value_label=f"{epoch['join']:.2f} s (lite.join)",
                baseline_label=f"{epoch[baseline]:.2f} s ({label})",
                note=f"lite.join: {coverage['join']}; {label}: {coverage[baseline]}; epochs {len(data['epoch_s']['join'])} per mode",
                raw=raw,
            )
        )
    return rows


def measure(quick: bool) -> list[Measurement]:
    log("join: even data")
    rows = [*_even(quick), *_even(quick, "fsdp"), *_even(quick, "deepspeed_stage_3")]
    log("join: uneven shards")
    return rows + _uneven(quick)
