"""A GAN (two models set up separately, the generator's loss through the discriminator) under
every strategy, against plain torch on one process over the global batch.

The loop is the user's (tests/scripts/_gan_common.py): the discriminator's step, then the
generator's, whose backward runs through the discriminator. Plain torch fills the
discriminator's gradients there too, and the recipe's zero_grad discards them before they are
used. Every parameter of both models must be plain torch's, or the run refused at once with
the way out: under DeepSpeed the discriminator is an engine whose hooks would reduce those
gradients (stage 1 then stepped with them, 2 and 3 failed), so such a backward is refused
before it starts, and the way out it names (the discriminator frozen for the generator's
step) is checked to be exact.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import assert_close
from _gan_common import PATTERNS, build, flat, reference

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install scopedlite[deepspeed])",
)
RUN_S = 150  # 2 ranks on 2 busy cores, 8 DeepSpeed engines


def deepspeed(name: str) -> object:
    return pytest.param(name, marks=[needs_deepspeed, pytest.mark.deepspeed_op])


@pytest.mark.timeout(RUN_S + 30)
@pytest.mark.parametrize(
    "strategy",
    [
        "single",
        "ddp",
        "fsdp",
        deepspeed("deepspeed_stage_1"),
        deepspeed("deepspeed_stage_2"),
        deepspeed("deepspeed_stage_3"),
    ],
)
def test_a_gan_trains_as_plain_torch_or_is_refused_at_once_with_the_way_out(script, strategy):
    result = script("gan", strategy, timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    out = result.json()
    world = 1 if strategy == "single" else 2
    refused = {"recipe": "step 0: g", "undetached": "step 0: d"} if strategy.startswith("deepspeed") else {}
    for pattern in PATTERNS:
        if pattern not in refused:
            assert "refused" not in out[pattern], f"{strategy} {pattern}: {out[pattern]['refused']}"
            assert_close(out[pattern], reference(pattern, world), 1e-6, f"{strategy}: {pattern}")
            continue
        # Refused before the backward started, on every rank (the run ended cleanly), naming
        # the other model and the way out: the generator has not changed.
        got = out[pattern]
        assert got["at"] == refused[pattern], got
        other = "discriminator" if pattern == "recipe" else "generator"  # models 1-2, 3-4, ... in PATTERNS order
        number = 2 * list(PATTERNS).index(pattern) + (2 if other == "discriminator" else 1)
        assert f"the parameters of the Sequential (model {number} set up in this run)" in got["refused"], got
        assert "requires_grad_(False)" in got["refused"] and "fake.detach()" in got["refused"]
        assert_close(got["g"], flat(build()[0].state_dict()), 0.0, f"{strategy}: {pattern}: the generator")


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
def test_at_zero_stage_0_a_loss_through_another_engine_is_refused_even_frozen(script):
    result = script("gan", "deepspeed_stage_0", timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    for case, message in result.json().items():
        assert "at ZeRO stage 0" in message and "strategy='ddp'" in message, (case, message)
