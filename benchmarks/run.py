"""Run every scopedlite benchmark side by side and write results.md, results.json, results.png.

    python benchmarks/run.py            # full run (~5.5 min on 2 shared cores)
    python benchmarks/run.py --quick    # fewer repeats (~4 min)
    python benchmarks/run.py --only import_time crash_latency
    python benchmarks/run.py --only launch_latency --merge   # keep the other rows of results.json

Measurements run one after another, never two multi-process runs at once, so they do not
disturb each other. A measurement that fails becomes a FAILED row with its reason; the others
still run. The plot is optional: without matplotlib it is skipped with a message.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import fields
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, Measurement, failed, log

# Module name -> what it measures. Order is the order of the table.
MODULES: dict[str, str] = {
    "ddp_vs_torchrun": "DDP training: scopedlite vs raw torchrun (and Fabric if installed)",
    "import_time": "import scopedlite on top of import torch",
    "crash_latency": "crash-to-error latency",
    "join_overhead": "lite.join overhead, even and uneven data",
    "launch_latency": "launch latency: script and fork launchers vs torchrun",
    "launch_timeline": "launch timeline: each phase of a short DDP run's start, both launchers vs torchrun",
    "sharded_memory": "sharded_init memory per rank: ddp vs fsdp vs deepspeed_stage_3",
    "collective_checks": "per-call cost of the shape check in lite.all_reduce / all_gather",
    "checkpoint_paths": "the same-path check of lite.save / lite.load: per call",
    "watchdog_overhead": "hang watchdog: per-step cost, and the cost of one look",
    "throughput_overhead": "lite.throughput: per-step cost of its window exchange",
    "stepped_compare": "fsdp: per-step cost of comparing the optimizers' steps at each backward",
    "save_stall": "lite.save(blocking=False): the training loop's stall per save vs a blocking save",
}
# Results written before rows carried their module: the module a row came from, by key prefix.
_KEY_PREFIXES = {
    "ddp_": "ddp_vs_torchrun",
    "import_": "import_time",
    "crash_": "crash_latency",
    "join_": "join_overhead",
}


def module_of(result: dict[str, object]) -> str:
    """The measurement module a row of results.json belongs to."""
    if result.get("module"):
        return str(result["module"])
    key = str(result.get("key", ""))
    return next((m for prefix, m in _KEY_PREFIXES.items() if key.startswith(prefix)), key)


def as_json(rows: list[Measurement], date: str) -> list[dict[str, object]]:
    """The rows for results.json, each with the module that measured it and when."""
    return [dict(r.to_json(), module=MODULE_OF_ROW[id(r)], measured=date) for r in rows]


def merge_previous(
    path: Path, rows: list[Measurement], ran: set[str], date: str
) -> tuple[list[Measurement], list[dict[str, object]], list[str]]:
    """Rows of the modules not run now, taken from the previous results.json, with the fresh ones
    in table order. Returns the rows, their JSON (each with its module and measurement date) and
    one line per earlier run the kept rows come from."""
    fresh = as_json(rows, date)
    kept: list[dict[str, object]] = []
    sources: list[str] = []
    if path.exists():
        previous = json.loads(path.read_text())
        old_date = str(previous.get("meta", {}).get("date", "?"))
        for result in previous.get("results", []):
            module = module_of(result)
            if module in ran or module not in MODULES:
                continue
            kept.append(dict(result, module=module, measured=result.get("measured", old_date)))
        for module in dict.fromkeys(str(r["module"]) for r in kept):
            dates = sorted({str(r["measured"]) for r in kept if r["module"] == module})
            sources.append(f"`{module}`: {', '.join(dates)}")
    order = list(MODULES)
    merged = sorted(fresh + kept, key=lambda r: order.index(str(r["module"])))  # stable within a module
    names = {f.name for f in fields(Measurement)}
    return [Measurement(**{k: v for k, v in r.items() if k in names}) for r in merged], merged, sources


MODULE_OF_ROW: dict[int, str] = {}  # id(row) -> the module that measured it (for results.json)


def run_all(quick: bool, only: list[str]) -> list[Measurement]:
    rows: list[Measurement] = []
    for name, description in MODULES.items():
        if only and name not in only:
            continue
        log(f"== {name}: {description}")
        started = time.perf_counter()
        try:
            measure: Callable[[bool], list[Measurement]] = importlib.import_module(name).measure
            new = measure(quick)
        except Exception as e:  # noqa: BLE001 - one broken measurement must not lose the others
            new = [failed(name, description, "-", f"benchmarks/{name}.py", f"{type(e).__name__}: {e}")]
            traceback.print_exc()
        MODULE_OF_ROW.update((id(row), name) for row in new)
        rows += new
        log(f"== {name} done in {time.perf_counter() - started:.0f} s")
    return rows


def _fmt_ratio(row: Measurement) -> str:
    return "-" if row.ratio is None else f"{row.ratio:.3f}"


def _fmt_met(row: Measurement) -> str:
    if row.note.startswith("FAILED"):
        return "FAILED"
    if row.verdict:
        return row.verdict
    return {True: "yes", False: "**no**", None: "-"}[row.met]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_markdown(path: Path, rows: list[Measurement], meta: dict[str, object]) -> None:
    lines = [
        "# scopedlite benchmarks",
        "",
        f"Generated by `python {' '.join(str(a) for a in meta['argv'])}` on {meta['date']} "
        f"in {meta['duration_s']:.0f} s. Python {meta['python']}, torch {meta['torch']}, "
        f"{meta['cpus']} CPUs, load average {meta['load_before']} before / {meta['load_after']} after.",
        "See `benchmarks/README.md` for what each number means; raw samples are in `results.json`.",
        *(
            [
                (
                    f"Merged (`--merge`): only {', '.join(f'`{m}`' for m in meta['ran'])} ran then; the other rows "
                    f"are kept from earlier runs ({'; '.join(meta['kept_from'])})."
                )
            ]
            if meta.get("kept_from")
            else []
        ),
        "",
        "| Measurement | scopedlite | baseline | ratio | goal | met | how measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        value = row.value_label or ("-" if row.value is None else f"{row.value:.3g} {row.unit}")
        baseline = row.baseline_label or ("-" if row.baseline is None else f"{row.baseline:.3g} {row.unit}")
        lines.append(
            "| "
            + " | ".join(
                _cell(c) for c in (row.title, value, baseline, _fmt_ratio(row), row.goal, _fmt_met(row), row.method)
            )
            + " |"
        )
    lines += ["", "## Notes per row", ""]
    for row in rows:
        if row.note:
            lines.append(f"- **{row.title}**: {row.note}")
    path.write_text("\n".join(lines) + "\n")


DOCS_PAGE = BENCH_DIR.parent / "docs" / "benchmarks.md"
DOCS_START, DOCS_END = "<!-- results:start (written by benchmarks/run.py) -->", "<!-- results:end -->"


def update_docs_page(page: Path, results_md: str) -> str:
    """Copy the table and notes of results.md between the markers of the docs page, so the
    site shows the latest numbers. Returns what happened, for the log."""
    if not page.exists() or DOCS_START not in page.read_text():
        return f"{page} has no results markers: not updated"
    body = results_md.split("\n", 2)[2]  # without the "# scopedlite benchmarks" title
    body = body.replace(
        "See `benchmarks/README.md` for what each number means; raw samples are in `results.json`.\n", ""
    )
    body = body.replace("## Notes per row", "### Notes per row")
    text = page.read_text()
    head, rest = text.split(DOCS_START, 1)
    tail = rest.split(DOCS_END, 1)[1]
    page.write_text(f"{head}{DOCS_START}\n\n{body.strip()}\n\n{DOCS_END}{tail}")
    return f"updated {page}"


def write_plot(path: Path, rows: list[Measurement]) -> str:
    """Bar chart: comparison ratios on the left, absolute measurements as a fraction of their
    budget on the right; a marker shows each goal. Returns what happened, for the log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: results.png skipped (pip install matplotlib to get it)"
    # Of the launch timeline only the phases with a goal: the others are in the table.
    timeline_shown = ("launch_timeline_first_line", "launch_timeline_exit")
    ratios = [
        r
        for r in rows
        if r.ratio is not None
        and not r.key.startswith("import")
        and (not r.key.startswith("launch_timeline") or r.key in timeline_shown)
    ]
    budgets = [r for r in rows if r.goal_fraction is not None]
    fig, axes = plt.subplots(
        1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [max(1, len(ratios)), max(1, len(budgets))]}
    )
    left, right = axes
    _bars(left, ratios, [r.ratio for r in ratios], [r.goal_ratio for r in ratios])  # type: ignore[misc]
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_title("ratio scopedlite / baseline (lower is better)")
    _bars(right, budgets, [r.goal_fraction for r in budgets], [1.0] * len(budgets))  # type: ignore[misc]
    right.set_title("fraction of the goal's budget (<= 1 meets it)")
    fig.text(
        0.01, 0.01, "dashed: goal. green: met, red: not met, orange: repeats span the goal, blue: info only", fontsize=8
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def _bars(ax: object, rows: list[Measurement], heights: list[float], goals: list[float | None]) -> None:
    labels = [_short(r) for r in rows]
    colours = [_colour(r) for r in rows]
    xs = list(range(len(rows)))
    ax.bar(xs, heights, color=colours)  # type: ignore[attr-defined]
    for x, h, goal in zip(xs, heights, goals):
        ax.text(x, h, f"{h:.3f}", ha="center", va="bottom", fontsize=8)  # type: ignore[attr-defined]
        if goal is not None:
            ax.hlines(goal, x - 0.4, x + 0.4, colors="black", linestyles="dashed")  # type: ignore[attr-defined]
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)  # type: ignore[attr-defined]


def _colour(row: Measurement) -> str:
    """green: goal met; red: not met; orange: the repeats fall on both sides of the goal;
    blue: no goal (reported for information)."""
    if "inconclusive" in row.verdict:
        return "tab:orange"
    return "tab:green" if row.met else "tab:red" if row.met is False else "tab:blue"


def _short(row: Measurement) -> str:
    return {
        "ddp_step_vs_torchrun": "DDP step\nvs torchrun",
        "ddp_wall_vs_torchrun": "DDP wall\nvs torchrun",
        "ddp_step_vs_fabric": "DDP step\nvs Fabric",
        "ddp_wall_vs_fabric": "DDP wall\nvs Fabric",
        "import_cached": "import\n(.pyc cached)",
        "import_api_cached": "import + API\n(.pyc cached)",
        "import_api_uncached": "import + API\n(no .pyc)",
        "crash_raise": "crash: raise",
        "crash_sigkill": "crash: SIGKILL",
        "crash_busy": "crash: raise,\nrank 0 busy",
        "join_even": "join even\nper step",
        "join_list": "join plain list\nper step",
        "join_uneven_vs_padded": "join uneven\nvs padded",
        "join_uneven_vs_torch_join": "join uneven\nvs torch Join",
        "launch_script": "launch: script\nvs torchrun",
        "launch_fork": "launch: fork\nvs torchrun",
        "launch_timeline_first_line": "timeline: script\nfirst line",
        "launch_timeline_exit": "timeline: script\nwhole run",
        "sharded_memory_ddp": "params/rank\nddp",
        "sharded_memory_fsdp": "params/rank\nfsdp",
        "sharded_memory_deepspeed_stage_3": "params/rank\nZeRO-3",
    }.get(row.key, row.key)


def _load() -> str:
    try:
        return "/".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats: about half the time, noisier")
    parser.add_argument("--only", nargs="*", default=[], choices=list(MODULES), help="run only these measurements")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: keep the rows of the other measurements from the existing results.json",
    )
    args = parser.parse_args()
    if args.merge and not args.only:
        parser.error("--merge needs --only (a full run replaces every row)")

    started = time.perf_counter()
    load_before = _load()
    rows = run_all(args.quick, args.only)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "quick": args.quick,
        "duration_s": time.perf_counter() - started,
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_before": load_before,
        "load_after": _load(),
        "argv": sys.argv,
        "ran": args.only or list(MODULES),
    }
    if args.merge:
        rows, results, kept_from = merge_previous(BENCH_DIR / "results.json", rows, set(args.only), str(meta["date"]))
        meta["kept_from"] = kept_from
    else:
        results = as_json(rows, str(meta["date"]))
    write_markdown(BENCH_DIR / "results.md", rows, meta)
    (BENCH_DIR / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    log(write_plot(BENCH_DIR / "results.png", rows))
    log(update_docs_page(DOCS_PAGE, (BENCH_DIR / "results.md").read_text()))
    log(f"wrote {BENCH_DIR / 'results.md'} and results.json in {meta['duration_s']:.0f} s")
    print((BENCH_DIR / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
