"""DDP on real gloo processes trains to the same parameters as one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import reference_training  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _close(a, b, tol=1e-5):
    return all(abs(x - y) <= tol for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize("devices", [2, 3])
def test_ddp_matches_single_process_over_the_global_batch(script, devices):
    n, batch = 12 * devices, 4
    result = script("train", "ddp", devices, n, batch)
    assert result.returncode == 0, result.explain()
    out = result.json()
    reference = reference_training(n, devices, batch)
    expected = [p.detach().flatten().tolist() for p in reference.parameters()]
    assert _close(out["params"], expected), (out["params"][0][:4], expected[0][:4])
    # parameters identical on every rank
    first = out["first_param_on_each_rank"]
    assert all(row == first[0] for row in first)


def test_single_strategy_gives_the_single_process_result(script):
    n, batch = 24, 8
    result = script("train", "single", 1, n, batch)
    assert result.returncode == 0, result.explain()
    reference = reference_training(n, 1, batch)
    expected = [p.detach().flatten().tolist() for p in reference.parameters()]
    assert _close(result.json()["params"], expected)
