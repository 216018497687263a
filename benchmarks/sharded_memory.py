"""Measurement: memory per rank of a model built in ``lite.sharded_init()``, ddp vs fsdp vs ZeRO-3.

``scripts/sharded_memory.py`` builds 8 x ``Linear(1024, 1024)`` (33.6 MB of float32
parameters) inside ``lite.sharded_init()`` on 2 CPU ranks and sets it up with ``lite.setup``.
Two numbers per rank: the bytes of parameter storage it holds (exact: the local shard, or the
whole parameter under DDP) and the growth of its resident set size (RSS) from before
``sharded_init`` to after the build and after ``setup``, measured after a GC and glibc's
``malloc_trim``. Setting up a model costs memory of its own (the first DDP/FSDP/engine
set-up loads code and allocates buffers: about 80 MB here even for one 8x8 layer), so every
strategy is also run with that one tiny layer (the control) and the RSS figures are given net
of it. The worst rank is reported. DeepSpeed rows need the ``deepspeed`` extra; without it
they say so.
"""

from __future__ import annotations

import importlib.util

from common import (
    PYTHON,
    SCRIPTS_DIR,
    Measurement,
    bench_env,
    failed,
    log,
    read_json,
    run_child,
    temp_path,
)

STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_3")
METHOD = (
    "8 x Linear(1024, 1024) built in lite.sharded_init() + lite.setup(model), 2 CPU procs; parameter bytes "
    "held per rank (local shard); RSS growth (after gc + malloc_trim) from before sharded_init, net of the "
    "same run with one 8x8 layer; worst rank"
)
MB = 1e6


def _run(strategy: str, variant: str) -> tuple[dict | None, str]:
    out = temp_path()
    result = run_child(
        [PYTHON, str(SCRIPTS_DIR / "sharded_memory.py"), strategy, str(out), variant], bench_env(), timeout=300
    )
    try:
        if not result.ok or not out.exists():
            return None, result.describe()
        return read_json(out), ""
    finally:
        out.unlink(missing_ok=True)


def _growth(report: dict, stage: str) -> float:
    """The largest growth of RSS over the ranks, from before sharded_init to ``stage``."""
    return max(r[stage] - r["rss_before"] for r in report["ranks"])


def measure(quick: bool) -> list[Measurement]:
    rows = []
    for strategy in STRATEGIES:
        title = f"sharded_init memory per rank (33.6 MB model, 2 ranks): {strategy}"
        sharded = strategy != "ddp"
        goal = "params <= 1/2 of the model" if sharded else "- (reference: every rank holds all)"
        if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
            rows.append(
                failed(
                    f"sharded_memory_{strategy}",
                    title,
                    goal,
                    METHOD,
                    "deepspeed is not installed (pip install scopedlite[deepspeed])",
                )
            )
            continue
        big, error = _run(strategy, "big")
        control, control_error = _run(strategy, "control") if big else (None, "")
        if big is None or control is None:
            rows.append(
                failed(f"sharded_memory_{strategy}", title, goal, METHOD, (error or control_error).splitlines()[0])
            )
            log(f"  memory {strategy}: FAILED {error or control_error}")
            continue
        full = big["full_bytes"]
        params = max(r["param_bytes"] for r in big["ranks"])
        built = _growth(big, "rss_built") - _growth(control, "rss_built")
        ready = _growth(big, "rss_ready") - _growth(control, "rss_ready")
        log(
            f"  memory {strategy}: params {params / MB:.1f} MB of {full / MB:.1f}; "
            f"RSS net {built / MB:+.1f} MB built, {ready / MB:+.1f} MB set up"
        )
        half = -(-full // 2) + 4096  # a shard may be padded by a few elements
        rows.append(
            Measurement(
                key=f"sharded_memory_{strategy}",
                title=title,
                unit="MB",
                value=params / MB,
                baseline=full / MB,
                ratio=params / full,
                goal=goal,
                met=(params <= half) if sharded else None,
                goal_ratio=0.5 if sharded else None,
                method=METHOD,
                value_label=f"params {params / MB:.1f} MB; RSS {built / MB:+.1f} MB built, {ready / MB:+.1f} MB set up",
                baseline_label=f"whole model {full / MB:.1f} MB",
                note=(
                    f"raw RSS growth (big model) {_growth(big, 'rss_built') / MB:.1f} MB built, "
                    f"{_growth(big, 'rss_ready') / MB:.1f} MB set up; control (one 8x8 layer) "
                    f"{_growth(control, 'rss_built') / MB:.1f} / {_growth(control, 'rss_ready') / MB:.1f} MB; "
                    "params per rank " + ", ".join(f"{r['param_bytes'] / MB:.2f}" for r in big["ranks"]) + " MB"
                ),
                raw={"big": big, "control": control},
            )
        )
    return rows
