"""Measurement: where the time of a launch goes, phase by phase, for both launchers and torchrun.

``scripts/launch_phases.py`` runs the same short 2-rank DDP program three ways: under
scopedlite's script launcher (``lite.launch(strategy="ddp")``: rank 1 re-executes the
script), its fork launcher (``strategy="ddp_fork"``, what a notebook uses), and as plain torch
under torchrun (the agent is ``torch.distributed.run.main``, started by the same script so
that it can stamp its own start; it then starts two plain workers). Every process writes
``time.time()`` at each phase it passes; the driver takes ``time.time()`` just before
spawning the command and at its exit. A phase's time is measured from the driver's spawn
to the moment the *last* process that has to pass it did (rank 0 alone for its own import
and store, every rank for the group, the barrier and the step): the first moment the run as
a whole is there. Median over repeats that alternate between the three ways; the ratios are
against torchrun's median for the same phase.

scopedlite is imported from a compiled copy on ``PYTHONPATH`` (``.pyc`` written, as ``pip
install`` leaves it; ``common.installed_env``), as in ``import_time.py``: with ``PYTHONDONTWRITEBYTECODE=1`` (this
environment) the source tree would be compiled again in every process at every start, which
torch, installed and compiled, never is.
"""

from __future__ import annotations

import time
from pathlib import Path

from common import (
    PYTHON,
    SCRIPTS_DIR,
    Measurement,
    failed,
    free_port,
    installed_env,
    log,
    median,
    noise_verdict,
    run_child,
    safe_ratio,
    temp_path,
)

MODES = ("script", "fork", "torchrun")
# (key, title, who must have passed it): "launcher" is rank 0 / torchrun's agent, "workers"
# the processes the launcher started, "ranks" every rank of the run.
PHASES = (
    ("start", "interpreter start (launching process)", "launcher"),
    ("torch", "`import torch` done (launching process)", "launcher"),
    ("ours", "`import scopedlite` + `lite.launch` resolved (rank 0)", "launcher"),
    ("store", "rendezvous store listening (rank 0 / torchrun's agent)", "launcher"),
    ("worker_start", "worker interpreters started (every started process)", "workers"),
    ("worker_torch", "`import torch` done in the started processes", "workers"),
    ("group", "process group made on every rank (`init_process_group` returned)", "ranks"),
    ("first_line", "first line of the block on every rank", "ranks"),
    ("setup", "model set up for DDP on every rank", "ranks"),
    ("barrier", "first barrier passed on every rank", "ranks"),
    ("step", "one training step done on every rank", "ranks"),
    ("block_end", "block ended (rank 0 after `with`; torchrun: every worker after destroy)", "end"),
    ("exit", "the command exited", "exit"),
)
# Goals of issue 41, judged on the medians: the script launcher to the first line and to the
# exit of the whole short run, the fork launcher to the first line.
GOALS = {("script", "first_line"): 0.75, ("fork", "first_line"): 0.5, ("script", "exit"): 0.85}
METHOD = (
    "2 CPU procs, gloo, OMP_NUM_THREADS=1; the same short DDP program (Linear(8, 8), one barrier, one step); "
    "time.time() stamps written by every process at each phase, from the driver's time.time() before spawn "
    "to the last process that has to pass it; scopedlite from a compiled copy (.pyc, as installed); "
    "median of {n}, the three ways alternating"
)


def _read_stamps(out: Path) -> list[tuple[str, dict[str, float]]]:
    """(role, phase -> time) of every process that wrote ``OUT.<pid>``."""
    processes = []
    for path in sorted(out.parent.glob(f"{out.name}.*")):
        role, stamps = "?", {}
        for line in path.read_text().splitlines():
            phase, value = line.rsplit(" ", 1)
            if phase.startswith("role "):
                role = phase.split(" ", 1)[1]
            else:
                stamps.setdefault(phase, float(value))  # the first store: the one the rendezvous made
        processes.append((role, stamps))
        path.unlink()
    return processes


def _timeline(
    mode: str, processes: list[tuple[str, dict[str, float]]], started: float, ended: float
) -> dict[str, float]:
    """Phase -> seconds since the spawn, for one run (a phase nobody stamped is left out)."""
    launcher = [s for role, s in processes if role == "launcher"]
    workers = [s for role, s in processes if role == "worker"]
    if len(launcher) != 1 or len(workers) != 2 - (mode != "torchrun"):
        raise RuntimeError(
            f"{mode}: expected one launching process and its workers, got roles {[r for r, _ in processes]}"
        )
    ranks = workers if mode == "torchrun" else launcher + workers
    rows: dict[str, float] = {}
    for key, _title, who in PHASES:
        if who == "exit":
            rows[key] = ended - started
            continue
        if key == "worker_start":
            group, phase = workers, "start"
        elif key == "worker_torch":
            group, phase = workers, "torch"
        else:
            group, phase = (
                {
                    "launcher": launcher,
                    "workers": workers,
                    "ranks": ranks,
                    "end": launcher if mode != "torchrun" else ranks,
                }[who],
                key,
            )
        values = [s[phase] for s in group if phase in s]
        if values and len(values) == len(group):
            rows[key] = max(values) - started
    return rows


def _run(mode: str) -> dict[str, float]:
    out = temp_path(".stamps")
    script = str(SCRIPTS_DIR / "launch_phases.py")
    cmd = [PYTHON, script, "agent" if mode == "torchrun" else mode, str(out)]
    if mode == "torchrun":
        cmd += [
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            script,
            "torchrun",
            str(out),
        ]
    started = time.time()
    result = run_child(cmd, installed_env(), timeout=120)
    ended = time.time()
    processes = _read_stamps(out)
    if not result.ok:
        raise RuntimeError(result.describe())
    return _timeline(mode, processes, started, ended)


def _table(medians: dict[str, dict[str, float]]) -> str:
    """The phases as a markdown table (for the note and the log)."""
    lines = ["| phase | script | fork | torchrun | script / torchrun | fork / torchrun |", "|---|---|---|---|---|---|"]
    for key, title, _who in PHASES:
        cells = [f"{medians[m][key]:.2f} s" if key in medians[m] else "-" for m in MODES]
        base = medians["torchrun"].get(key)
        ratios = [f"{medians[m][key] / base:.2f}" if key in medians[m] and base else "-" for m in ("script", "fork")]
        lines.append(f"| {title} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def _label(value: float | None, mode: str, base: float | None) -> str:
    """A mode's median and its ratio to torchrun's (``base``), as a results row shows them."""
    if value is None:
        return f"{mode} -"
    ratio = safe_ratio(value, base)
    return f"{mode} {value:.2f} s" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def measure(quick: bool) -> list[Measurement]:
    repeats = 3 if quick else 5
    method = METHOD.format(n=repeats)
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    problems: list[str] = []
    for repeat in range(repeats):
        for mode in MODES:
            try:
                timeline = _run(mode)
            except RuntimeError as e:
                problems.append(f"{mode}: {str(e).splitlines()[0]}")
                log(f"  timeline {mode}: FAILED {e}")
                continue
            samples[mode].append(timeline)
            log(
                f"  timeline {mode} ({repeat + 1}/{repeats}): " + ", ".join(f"{k} {v:.2f}" for k, v in timeline.items())
            )
    if not all(samples.values()):
        return [failed("launch_timeline", "Launch timeline", "-", method, "; ".join(problems) or "no run")]
    medians = {
        m: {k: median([t[k] for t in samples[m] if k in t]) for k, _, _ in PHASES if any(k in t for t in samples[m])}
        for m in MODES
    }
    log("launch timeline (median seconds since the command was started):\n" + _table(medians))
    rows = []
    for key, title, _who in PHASES:
        base = medians["torchrun"].get(key)
        script, fork = medians["script"].get(key), medians["fork"].get(key)
        goals = {m: GOALS[(m, key)] for m in ("script", "fork") if (m, key) in GOALS}
        met = None
        verdict = ""
        if goals and base:
            ok = all(medians[m][key] / base <= g for m, g in goals.items())
            met = ok
            per_pair = {m: [t[key] / b[key] for t, b in zip(samples[m], samples["torchrun"])] for m in goals}
            verdict = "; ".join(
                f"{m}: {noise_verdict(medians[m][key] / base <= g, per_pair[m], g)}" for m, g in goals.items()
            )
        fork_ratio = safe_ratio(fork, base)

        rows.append(
            Measurement(
                key=f"launch_timeline_{key}",
                title=f"Launch timeline: {title}",
                unit="s",
                value=script,
                baseline=base,
                ratio=safe_ratio(script, base),
                goal=", ".join(f"{m} <= {g}x" for m, g in goals.items()) or "- (timeline)",
                goal_ratio=goals.get("script", goals.get("fork")),
                met=met,
                verdict=verdict,
                method=method if key == PHASES[0][0] else "as the first launch-timeline row",
                value_label=f"{_label(script, 'script', base)}; {_label(fork, 'fork', base)}",
                baseline_label="-" if base is None else f"{base:.2f} s (torchrun)",
                note=(
                    f"script samples {', '.join(f'{t[key]:.2f}' for t in samples['script'] if key in t) or '-'}; "
                    f"fork {', '.join(f'{t[key]:.2f}' for t in samples['fork'] if key in t) or '-'}; "
                    f"torchrun {', '.join(f'{t[key]:.2f}' for t in samples['torchrun'] if key in t) or '-'}"
                    + (f"; fork / torchrun {fork_ratio:.3f}" if fork_ratio is not None else "")
                    + (f"; problems: {'; '.join(problems)}" if problems else "")
                ),
                raw={m: [t.get(key) for t in samples[m]] for m in MODES},
            )
        )
    return rows
