"""Measurement (a): the same DDP training loop under scopedlite, raw torchrun, and Fabric.

Each variant is a fresh multi-process run of a script in ``scripts/``; the variants are
alternated (A, B, A, B, ...) so that a machine that gets busier or quieter during the run
(another job, thermal state) affects them alike, and medians are taken over the repeats.

- Step time: measured inside the loop on rank 0 with ``perf_counter`` (warm-up steps
  excluded); each run contributes its median, the variant's figure is the median of those.
- Wall time: the whole command, from spawning it to its exit, seen from this process; it
  includes interpreter and torch start-up of every process, rendezvous and teardown.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

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
    quantile,
    read_json,
    run_child,
    safe_ratio,
    temp_path,
)

WARMUP = 10
STEPS = 60
STEP_GOAL = 1.01
WALL_GOAL = 0.95
STEP_METHOD = (
    f"MLP 3x512, batch 64, SGD, 2 CPU procs (gloo), OMP_NUM_THREADS=1; rank 0 times each of "
    f"{STEPS} steps after {WARMUP} warm-up with perf_counter (batch fetch included); median per "
    "run, median over alternating runs"
)
WALL_METHOD = "same runs: subprocess spawn to exit of the whole command, median over alternating runs"


@dataclass
class Variant:
    """One way of starting the training script and the numbers its runs produced."""

    name: str
    script: str
    torchrun: bool = False
    step_medians: list[float] = field(default_factory=list)
    step_p10s: list[float] = field(default_factory=list)
    step_cpu_medians: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def command(self, out: str) -> list[str]:
        args = [str(SCRIPTS_DIR / self.script), out, str(WARMUP), str(STEPS)]
        if self.torchrun:
            launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
            rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
            return [PYTHON, *launcher, *rendezvous, *args]
        return [PYTHON, *args]

    def run_once(self) -> None:
        out = temp_path()
        result = run_child(self.command(str(out)), installed_env())
        if not result.ok or not out.exists():
            self.errors.append(result.describe())
            log(f"  {self.name}: FAILED ({result.describe().splitlines()[0]})")
            return
        data = read_json(out)
        out.unlink()
        steps = data["step_s"]
        self.step_cpu_medians.append(median(data["step_cpu_s"]))
        self.step_medians.append(median(steps))
        self.step_p10s.append(quantile(steps, 0.1))
        self.walls.append(result.wall_s)
        log(f"  {self.name}: step {median(steps) * 1e3:.2f} ms, wall {result.wall_s:.2f} s")


def fabric_available() -> bool:
    """Whether Lightning Fabric can be imported (it is never installed by this benchmark)."""
    return any(importlib.util.find_spec(name) is not None for name in ("lightning", "lightning_fabric"))


def _pair_ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def _compare(lite: Variant, other: Variant, label: str) -> list[Measurement]:
    """The step-time and wall-time rows for scopedlite against one baseline."""
    key = other.name
    if lite.errors or other.errors or not lite.step_medians or not other.step_medians:
        reason = "; ".join((lite.errors + other.errors)[:1]) or "no successful run"
        return [
            failed(
                f"ddp_step_vs_{key}",
                f"DDP step time: scopedlite vs {label}",
                f"ratio <= {STEP_GOAL}",
                STEP_METHOD,
                reason,
            ),
            failed(
                f"ddp_wall_vs_{key}",
                f"DDP whole-process wall time: scopedlite vs {label}",
                f"ratio <= {WALL_GOAL}",
                WALL_METHOD,
                reason,
            ),
        ]
    step_l, step_o = median(lite.step_medians), median(other.step_medians)
    wall_l, wall_o = median(lite.walls), median(other.walls)
    step_pairs = _pair_ratios(lite.step_medians, other.step_medians)
    wall_pairs = _pair_ratios(lite.walls, other.walls)
    step_ratio, wall_ratio = safe_ratio(step_l, step_o), safe_ratio(wall_l, wall_o)
    assert step_ratio is not None and wall_ratio is not None
    # The fastest decile of steps is what a step costs when no other process takes the CPU:
    # a second estimate of the ratio that is far less sensitive to a busy machine.
    p10_ratio = median(lite.step_p10s) / median(other.step_p10s)
    cpu_l, cpu_o = median(lite.step_cpu_medians), median(other.step_cpu_medians)
    return [
        Measurement(
            key=f"ddp_step_vs_{key}",
            title=f"DDP step time: scopedlite vs {label}",
            unit="ms",
            value=step_l * 1e3,
            baseline=step_o * 1e3,
            ratio=step_ratio,
            goal=f"ratio <= {STEP_GOAL}",
            goal_ratio=STEP_GOAL,
            met=step_ratio <= STEP_GOAL,
            verdict=noise_verdict(step_ratio <= STEP_GOAL, step_pairs, STEP_GOAL),
            method=STEP_METHOD,
            value_label=f"{step_l * 1e3:.2f} ms",
            baseline_label=f"{step_o * 1e3:.2f} ms ({label})",
            note=(
                f"per-pair ratios {', '.join(f'{r:.3f}' for r in step_pairs)}; fastest-decile step "
                f"{median(lite.step_p10s) * 1e3:.2f} vs {median(other.step_p10s) * 1e3:.2f} ms, ratio {p10_ratio:.3f} "
                f"(less sensitive to other load); rank-0 CPU time per step {cpu_l * 1e3:.2f} vs "
                f"{cpu_o * 1e3:.2f} ms, ratio {cpu_l / cpu_o:.3f}"
            ),
            raw={
                "scopedlite_step_medians_s": lite.step_medians,
                f"{key}_step_medians_s": other.step_medians,
                "scopedlite_step_p10_s": lite.step_p10s,
                f"{key}_step_p10_s": other.step_p10s,
                "p10_ratio": p10_ratio,
                "scopedlite_step_cpu_medians_s": lite.step_cpu_medians,
                f"{key}_step_cpu_medians_s": other.step_cpu_medians,
            },
        ),
        Measurement(
            key=f"ddp_wall_vs_{key}",
            title=f"DDP whole-process wall time: scopedlite vs {label}",
            unit="s",
            value=wall_l,
            baseline=wall_o,
            ratio=wall_ratio,
            goal=f"ratio <= {WALL_GOAL}",
            goal_ratio=WALL_GOAL,
            met=wall_ratio <= WALL_GOAL,
            verdict=noise_verdict(wall_ratio <= WALL_GOAL, wall_pairs, WALL_GOAL),
            method=WALL_METHOD,
            value_label=f"{wall_l:.2f} s",
            baseline_label=f"{wall_o:.2f} s ({label})",
            note=f"per-pair ratios {', '.join(f'{r:.3f}' for r in wall_pairs)}",
            raw={"scopedlite_walls_s": lite.walls, f"{key}_walls_s": other.walls},
        ),
    ]


def measure(quick: bool) -> list[Measurement]:
    """Run the variants alternately and return their comparison rows."""
    repeats = 2 if quick else 3
    lite = Variant("scopedlite", "ddp_lite.py")
    raw = Variant("torchrun", "ddp_raw.py", torchrun=True)
    variants = [lite, raw]
    fabric = Variant("fabric", "ddp_fabric.py") if fabric_available() else None
    if fabric is not None:
        variants.append(fabric)
    for repeat in range(repeats):
        log(f"DDP vs torchrun: round {repeat + 1}/{repeats}")
        for variant in variants:
            variant.run_once()
    rows = _compare(lite, raw, "raw PyTorch + torchrun")
    if fabric is not None:
        rows += _compare(lite, fabric, "Lightning Fabric")
    else:
        rows.append(
            Measurement(
                key="ddp_vs_fabric",
                title="DDP step and wall time: scopedlite vs Lightning Fabric",
                unit="",
                value=None,
                baseline=None,
                ratio=None,
                goal="-",
                met=None,
                method="skipped: neither `lightning` nor `lightning_fabric` is importable (not installed on purpose)",
                value_label="-",
                baseline_label="Fabric not installed",
                note="Fabric not installed",
            )
        )
    return rows
