"""Measurement (d): what ``lite.join`` costs.

(i) Even data, where join has nothing to do: per-step time with and without
``with lite.join(model):``, in one launch, blocks rotating (see ``scripts/join_even.py``),
with torch's bare ``Join([model])`` as a reference for what join mode costs in torch itself.
Goal: join / no join <= 1.02 (ratio of pooled medians; every block runs all modes back to
back, so drift cancels per block, and the per-block ratios tell the noise). The same launch
runs the same batches as a plain list (a loop whose length join does not know, where a round
opens at every step's forward) with and without join: goal <= 1.05.

(ii) Uneven shards: epoch wall time of ``lite.join`` (every sample once, ranks finish at
different steps) against the padded sampler outside join (every rank gets the same count by
repeating samples) and torch's bare ``Join`` over the same shards. Goal: <= 1.1 x torch's.
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
    spread,
    temp_path,
)

EVEN_WARMUP = 5
EVEN_STEPS = 60
UNEVEN_SAMPLES = 1000
UNEVEN_BATCH = 1
UNEVEN_RANKS = 3
EVEN_GOAL = 1.02
LIST_GOAL = 1.05  # a plain loop: at most one small collective per step
# The protocol's rounds per step of a plain loop on even data, from its third step, as
# tests/test_join.py counts them (posted: opened without waiting, read at the next round).
LIST_ROUNDS = {
    "ddp": "one round per step, posted (its backward's)",
    "fsdp": "two rounds per step (the forward's posted, the backward's awaited)",
    "deepspeed_stage_3": "three rounds per step (the forward's and the step's posted, the backward's awaited)",
}
UNEVEN_GOAL = 1.1
EVEN_METHOD = (
    f"one 2-proc launch; blocks of {EVEN_WARMUP}+{EVEN_STEPS} steps (MLP 3x512, batch 64) without "
    "join, in lite.join, in torch Join (ddp), over a set-up loader and over a plain list of its batches, "
    "rotating; rank 0 perf_counter per step, warm-up excluded; "
    "ratio of pooled medians, per-block ratios in the note"
)
UNEVEN_METHOD = (
    f"{UNEVEN_SAMPLES} samples on {UNEVEN_RANKS} CPU procs, batch {UNEVEN_BATCH}, one launch, modes "
    "rotating per epoch; epoch timed on rank 0 between two barriers; median over epochs"
)


def _even(quick: bool, strategy: str = "ddp") -> list[Measurement]:
    """Two rows from one launch: over a set-up loader (free when even) and over a plain list
    of the same batches (the rounds of ``LIST_ROUNDS`` at every step)."""
    blocks = 3 if quick else 6
    suffix = "" if strategy == "ddp" else f"_{strategy}"
    title = "Join on even data: per-step time, lite.join vs no join" + ("" if strategy == "ddp" else f" ({strategy})")
    list_title = "Join on even data over a plain list: per-step time, lite.join vs no join" + (
        "" if strategy == "ddp" else f" ({strategy})"
    )
    out = temp_path()
    command = [
        PYTHON,
        str(SCRIPTS_DIR / "join_even.py"),
        str(out),
        str(EVEN_WARMUP),
        str(EVEN_STEPS),
        str(blocks),
        strategy,
    ]
    result = run_child(command, bench_env(), timeout=300)
    if not result.ok or not out.exists():
        return [
            failed(f"join_even{suffix}", title, f"<= {EVEN_GOAL} x no join", EVEN_METHOD, result.describe()),
            failed(f"join_list{suffix}", list_title, f"<= {LIST_GOAL} x no join", EVEN_METHOD, result.describe()),
        ]
    data = read_json(out)
    out.unlink()
    torch_samples = [t for b in data["torch_join"] for t in b]
    torch_joined = median(torch_samples) if torch_samples else None
    reference = (
        f"torch's own Join([model]) (reference): {torch_joined * 1e3:.2f} ms/step"
        if torch_joined
        else ("torch's Join has no sharded counterpart")
    )
    return [
        _even_row(
            data,
            "plain",
            "join",
            f"join_even{suffix}",
            title,
            EVEN_GOAL,
            result.wall_s,
            f"{reference}; inside lite.join on even data: one round when the pass begins, none per step",
        ),
        _even_row(
            data,
            "list",
            "join_list",
            f"join_list{suffix}",
            list_title,
            LIST_GOAL,
            result.wall_s,
            f"{reference}; a loop over a list: {LIST_ROUNDS[strategy]}",
        ),
    ]


def _even_row(
    data: dict, base: str, mode: str, key: str, title: str, goal: float, wall_s: float, about: str
) -> Measurement:
    plain_blocks = [median(b) for b in data[base]]
    join_blocks = [median(b) for b in data[mode]]
    plain = median([t for b in data[base] for t in b])
    joined = median([t for b in data[mode] for t in b])
    ratio = safe_ratio(joined, plain)
    assert ratio is not None
    # Each block ran all modes back to back, so per-block ratios cancel slow drift.
    block_ratios = [j / p for j, p in zip(join_blocks, plain_blocks)]
    noise = spread(plain_blocks)
    log(f"{key}: no join {plain * 1e3:.2f} ms, join {joined * 1e3:.2f} ms ({ratio:.3f})")
    return Measurement(
        key=key,
        title=title,
        unit="ms",
        value=joined * 1e3,
        baseline=plain * 1e3,
        ratio=ratio,
        goal=f"<= {goal} x no join",
        goal_ratio=goal,
        met=ratio <= goal,
        verdict=noise_verdict(ratio <= goal, block_ratios, goal),
        method=EVEN_METHOD,
        value_label=f"{joined * 1e3:.2f} ms (join)",
        baseline_label=f"{plain * 1e3:.2f} ms (no join)",
        note=(
            f"per-block ratios {', '.join(f'{r:.3f}' for r in block_ratios)}; spread of no-join "
            f"blocks {noise:.1%}; {about}"
        ),
        raw={
            "plain_block_medians_s": plain_blocks,
            "join_block_medians_s": join_blocks,
            "block_ratios": block_ratios,
            "noise": noise,
            "wall_s": wall_s,
        },
    )


def _coverage(seen: list[list[int]]) -> str:
    """'334/333/333 batches, 1000 distinct, 0 repeated' for one mode."""
    flat = [i for rank in seen for i in rank]
    return (
        f"{'/'.join(str(len(r)) for r in seen)} samples per rank, "
        f"{len(set(flat))} distinct, {len(flat) - len(set(flat))} repeated"
    )


def _uneven(quick: bool) -> list[Measurement]:
    epochs = 1 if quick else 2
    title = f"Join on uneven shards ({UNEVEN_SAMPLES} samples, {UNEVEN_RANKS} ranks, batch {UNEVEN_BATCH}): epoch time"
    out = temp_path()
    command = [
        PYTHON,
        str(SCRIPTS_DIR / "join_uneven.py"),
        str(out),
        str(UNEVEN_SAMPLES),
        str(UNEVEN_BATCH),
        str(epochs),
        str(UNEVEN_RANKS),
    ]
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
        goal = baseline == "torch_join"
        per_epoch = [j / b for j, b in zip(data["epoch_s"]["join"], data["epoch_s"][baseline])]
        rows.append(
            Measurement(
                key=f"join_uneven_vs_{baseline}",
                title=f"{title}: lite.join vs {label}",
                unit="s",
                value=epoch["join"],
                baseline=epoch[baseline],
                ratio=ratio,
                goal=f"<= {UNEVEN_GOAL} x torch Join" if goal else "- (reported)",
                goal_ratio=UNEVEN_GOAL if goal else None,
                met=(ratio is not None and ratio <= UNEVEN_GOAL) if goal else None,
                verdict=noise_verdict(ratio is not None and ratio <= UNEVEN_GOAL, per_epoch, UNEVEN_GOAL)
                if goal
                else "",
                method=UNEVEN_METHOD,
                value_label=f"{epoch['join']:.2f} s (lite.join)",
                baseline_label=f"{epoch[baseline]:.2f} s ({label})",
                note=(
                    f"lite.join: {coverage['join']}; {label}: {coverage[baseline]}; "
                    f"epochs {len(data['epoch_s']['join'])} per mode; "
                    f"per-epoch ratios {', '.join(f'{r:.3f}' for r in per_epoch)}"
                ),
                raw=raw,
            )
        )
    return rows


def measure(quick: bool) -> list[Measurement]:
    log("join: even data")
    rows = [*_even(quick), *_even(quick, "fsdp"), *_even(quick, "deepspeed_stage_3")]
    log("join: uneven shards")
    return rows + _uneven(quick)
