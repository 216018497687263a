"""lite.profile: torch.profiler traces per rank, on real gloo ranks and on one process.

One launch per strategy runs tests/scripts/profile_run.py (a two-cycle schedule, chosen ranks,
uneven data inside join); the test opens each trace file as JSON and checks which steps it
recorded and that it holds the collectives of those steps. What is expected is written out
from torch's schedule (wait, warmup, active) and from what the model's backward must reduce:
DDP all-reduces the one gradient bucket of this small model once per step, FSDP2
reduce-scatters its one parameter group once per step.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import scopedlite as lite

pytestmark = pytest.mark.timeout(120)

# The collective each strategy's backward issues once per step for the test model.
GRADIENT_REDUCTION = {"ddp": "c10d::allreduce_", "fsdp": "c10d::_reduce_scatter_base_"}
# How many of it a step outside lite.join holds: under ddp also the ranks' comparison of their
# training forwards (ddp/counted.py), which pauses inside the block.
PER_STEP = {"ddp": 2, "fsdp": 1}


def _events(path: Path) -> Counter[str]:
    """How many complete events of each name the Chrome trace at ``path`` holds."""
    trace = json.loads(path.read_text())
    return Counter(e["name"] for e in trace["traceEvents"] if e.get("ph") == "X")


def _steps(events: Counter[str]) -> list[int]:
    return sorted(int(name.split("#")[1]) for name in events if name.startswith("ProfilerStep#"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_profile_traces_per_rank(script, tmp_path, strategy):
    result = script("profile_run", strategy, 2)
    assert result.returncode == 0, result.explain()
    ranks = result.json()
    reduction = GRADIENT_REDUCTION[strategy]

    # Every rank, wait 1 / warmup 1 / active 2, twice: steps 2-3 and 6-7 recorded, step 8 not.
    assert sorted(p.name for p in (tmp_path / "every").iterdir()) == [
        f"rank{r}.step{s}.pt.trace.json" for r in (0, 1) for s in (4, 8)
    ]
    for r in ranks:
        assert r["every"] == {
            "enabled": True,
            "traces": [f"rank{r['rank']}.step4.pt.trace.json", f"rank{r['rank']}.step8.pt.trace.json"],
        }
        for end, recorded in ((4, [2, 3]), (8, [6, 7])):
            events = _events(tmp_path / "every" / f"rank{r['rank']}.step{end}.pt.trace.json")
            assert _steps(events) == recorded
            assert events[reduction] == PER_STEP[strategy] * len(recorded), dict(events)
            assert any(name.startswith("gloo:") for name in events), "no backend collective in the trace"

    # ranks=[1]: rank 0 records nothing and writes nothing; rank 1 also records memory.
    assert [p.name for p in (tmp_path / "chosen").iterdir()] == ["rank1.step1.pt.trace.json"]
    assert ranks[0]["chosen"] == {"enabled": False, "traces": []}
    assert ranks[1]["chosen"] == {"enabled": True, "traces": ["rank1.step1.pt.trace.json"]}
    trace = json.loads((tmp_path / "chosen" / "rank1.step1.pt.trace.json").read_text())
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"]), "profile_memory=True recorded no allocation"

    # Inside join with 5 batches on rank 0 and 3 on rank 1 (wait 1, warmup 1, active 3): rank 0
    # records steps 2-4; rank 1 runs out after step 2 and writes it when its block closes
    # (torch opens ProfilerStep#3 at the last step() call: it holds no training step).
    assert sorted(p.name for p in (tmp_path / "joined").iterdir()) == [
        "rank0.step5.pt.trace.json",
        "rank1.step3.pt.trace.json",
    ]
    full = _events(tmp_path / "joined" / "rank0.step5.pt.trace.json")
    assert _steps(full) == [2, 3, 4]
    assert full[reduction] == 3, dict(full)
    short = _events(tmp_path / "joined" / "rank1.step3.pt.trace.json")
    assert _steps(short) == [2, 3]
    assert short[reduction] == 1, dict(short)


def test_profile_one_process(tmp_path):
    """Outside a launch the default one-process run is profiled, as rank 0."""
    model = torch.nn.Linear(4, 2)
    with lite.profile(tmp_path / "single", wait=0, warmup=1, active=2, record_shapes=True) as prof:
        assert prof.enabled
        for _ in range(4):
            model(torch.randn(3, 4)).sum().backward()
            prof.step()
    assert [p.name for p in prof.traces] == ["rank0.step3.pt.trace.json"]
    assert sorted(p.name for p in (tmp_path / "single").iterdir()) == ["rank0.step3.pt.trace.json"]
    events = _events(prof.traces[0])
    assert _steps(events) == [1, 2]
    assert events["aten::addmm"] == 2, dict(events)  # one forward per recorded step
    trace = json.loads(prof.traces[0].read_text())
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"]), "record_shapes=True recorded no shape"


def test_profile_disabled_does_nothing(tmp_path):
    with lite.profile(tmp_path / "off", enabled=False) as prof:
        for _ in range(6):
            prof.step()
    assert not prof.enabled and prof.profiler is None and prof.traces == []
    assert not (tmp_path / "off").exists()


def test_profile_chosen_rank_outside_world(tmp_path):
    with (
        pytest.raises(ValueError, match=r"rank\(s\) \[1\] do not exist in a world of 1; valid ranks are 0..0"),
        lite.profile(tmp_path, ranks=[0, 1]),
    ):
        pass


def test_profile_does_not_nest(tmp_path):
    with (
        lite.profile(tmp_path, enabled=False),
        pytest.raises(lite.ScopeError, match="already open"),
        lite.profile(tmp_path),
    ):
        pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"active": 0}, ValueError, r"active=0\): active must be an int >= 1"),
        ({"wait": -1}, ValueError, r"wait=-1\): wait must be an int >= 0"),
        ({"warmup": 1.5}, ValueError, r"warmup=1.5\)"),
        ({"repeat": True}, ValueError, r"repeat=True\)"),
        ({"ranks": 0}, TypeError, r"ranks=0\): ranks must be None \(every rank\) or a list"),
        ({"ranks": []}, ValueError, r"ranks=\[\]\): ranks must be a non-empty list"),
        ({"ranks": [0, "1"]}, ValueError, r"not \['1'\]"),
        ({"profile_memory": 1}, TypeError, r"profile_memory=1\): profile_memory must be True or False"),
        ({"folder": ""}, TypeError, r"folder=''\): folder must be a non-empty path"),
    ],
)
def test_profile_arguments_checked_at_once(kwargs, error, match):
    with pytest.raises(error, match=match):
        lite.profile(**kwargs)
