"""Fault injection: a fixed, seeded set of (rank, fault, point) cases on 3 real ranks.

Every case must end with a clear error naming the failed rank, within a bound, with no
process left behind.
"""

from __future__ import annotations

import random

import psutil
import pytest

pytestmark = pytest.mark.timeout(60)

MODES = ("raise", "kill", "abort", "sigterm")
POINTS = ("init", "forward", "collective", "save")
_rng = random.Random(20261129)
# Two seeded rounds: every fault kind meets a random point and a random worker in each round,
# so the set covers every kind and every point while staying small enough to run on 2 cores.
CASES = []
for _round in range(2):
    points = list(POINTS)
    _rng.shuffle(points)
    CASES += [(_rng.choice((1, 2)), mode, point) for mode, point in zip(MODES, points)]
# rank 0 is the main process: it raising must stop the workers too
CASES = list(dict.fromkeys(CASES)) + [(0, "raise", "forward"), (0, "raise", "collective")]

EXPECTED = {
    "raise": "RuntimeError: injected fault",
    "kill": "killed by SIGKILL",
    "abort": "aborted (SIGABRT)",
    "sigterm": "SystemExit: 143",
}


@pytest.mark.parametrize(("rank", "mode", "point"), CASES)
def test_fault_ends_the_run_cleanly(script, rank, mode, point):
    result = script("fault", rank, mode, point)
    out = result.json()
    if rank == 0:
        assert out["error"] == "RuntimeError", result.explain()
        assert "injected fault on rank 0" in out["message"]
    else:
        assert out["error"] == "WorkerFailedError", result.explain()
        assert out["ranks"] == [rank], out["message"]
        assert EXPECTED[mode] in out["message"], out["message"]
    assert out["latency"] is not None and out["latency"] < 3.0, out["latency"]
    for pid in out["pids"]:
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"process {pid} survived"
