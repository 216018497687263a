"""A Python number read from a sharded value (fsdp, model_parallel) is its whole value.

torch reads a DTensor that each rank holds part of (a norm or sum of sharded parameters, a
sharded tensor) as this rank's part, silently: the same script logged another, wrong number
on each rank (scopedlite/_strategies/fsdp/whole_numbers.py). A collective over DTensors that
rank 0's code starts alone, and lite.clip_gradients there, are refused at once
(fsdp/dtensor_collectives.py, the gather ledger). Real processes over gloo; every number is
compared with plain torch's on the unsharded model and the whole batch.
"""

from __future__ import annotations

import sys

import pytest

from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from _common import assert_close


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_numbers_read_from_sharded_values_are_whole_or_refused_at_once(script, strategy):
    result = script("whole_numbers", strategy)
    assert result.returncode == 0, result.explain()
    seen = result.json()
    assert "DTensor" in seen[0]["sharded"]  # the parameters are sharded: the reads are of parts
    for rank, out in enumerate(seen):
        expected, got = out["expected"], out["got"]
        assert set(got) == set(expected)
        for key in ("float_norms", "item_sums", "grad_norms", "tolist", "clip_norm", "clip_norm_item"):
            assert_close(got[key], expected[key], tol=1e-5, what=f"rank {rank} {key}")
        for key in ("int_positive", "bool_any_big", "f_string"):
            assert got[key] == expected[key], (rank, key)
        assert_close(out["after"], expected["float_norms"][0], what=f"rank {rank} after")
        # inside lite.join a whole value cannot be read: refused on every rank
        assert "inside lite.join" in out["in_join"] and "after the `with lite.join" in out["in_join"]
    # rank 0 alone: refused at once, naming the others' wait and the fix; the run went on
    alone = seen[0]["alone"]
    assert "read on rank(s) [0] only" in alone and "rank 1 waits in a collective" in alone, alone
    assert "Read it on every rank" in alone
    assert seen[1]["alone"] is None
    # collectives over DTensors started by rank 0's code alone, and lite.clip_gradients there
    others = seen[0]["others_alone"]
    assert set(others) == {"torch_clip", "full_tensor", "lite_clip"}, others
    for what in ("torch_clip", "full_tensor"):
        message = others[what]
        assert message.startswith("A DTensor collective (") and "whole_numbers.py:" in message, message
        assert "ran on rank(s) [0] only (rank 1 waits in a collective" in message, message
        assert "clip_grad_norm_(model.parameters(), 1.0)` everywhere" in message, message
    assert others["lite_clip"].startswith("lite.clip_gradients() was called on rank(s) [0] only (rank 1 waits"), others
    assert "Clip on every rank, then use the norm on one" in others["lite_clip"]
    assert seen[1]["others_alone"] == {}
    assert seen[0]["restored"]  # after the block, DTensor reads its numbers as torch does
