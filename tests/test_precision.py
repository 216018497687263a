"""Precision names: Fabric's, and its short spellings with Fabric's meaning (issue 24)."""

from __future__ import annotations

import re

import pytest

import scopedlite as lite
from scopedlite._core.precision import precision_for

CPU = lite.Machine(cpu_count=2)


@pytest.mark.parametrize(
    ("given", "meaning"),
    [
        ("bf16", "bf16-mixed"),
        ("16", "16-mixed"),
        (16, "16-mixed"),
        (32, "32-true"),
        ("32", "32-true"),
        ("64", "64-true"),
        (64, "64-true"),
    ],
)
def test_fabrics_short_precision_spellings_mean_what_they_mean_there(given, meaning):
    assert precision_for(given).name == meaning
    if meaning != "16-mixed":  # fp16 mixed needs an accelerator
        plan = lite.resolve(precision=given, accelerator="cpu", env={}, machine=CPU)
        assert plan.precision.name == meaning


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            "fp16",
            "precision='fp16' is HF Accelerate's mixed_precision name; scopedlite writes it as Fabric "
            "does: precision='16-mixed'",
        ),
        (
            "no",
            "precision='no' is HF Accelerate's mixed_precision name; "
            "scopedlite writes it as Fabric does: precision='32-true'",
        ),
        (16.0, "precision=16.0 is not a precision scopedlite knows"),
        (True, "precision=True is not a precision scopedlite knows"),
    ],
)
def test_other_spellings_are_refused_naming_the_replacement(given, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        precision_for(given)


def test_fabrics_16_on_cpu_is_refused_saying_what_it_means():
    expected = "precision=16 (Fabric's short name for '16-mixed') on accelerator='cpu'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        lite.resolve(precision=16, accelerator="cpu", env={}, machine=CPU)
    with (
        lite.launch(strategy="single", accelerator="cpu"),
        pytest.raises(ValueError, match=re.escape("lite.autocast(precision='16-mixed') on cpu")),
        lite.autocast("16"),
    ):
        pass


def test_short_spellings_agree_with_the_command_line_and_32_is_the_default():
    cli = {"SCOPEDLITE_CLI_PRECISION": "bf16-mixed"}
    assert lite.resolve(precision="bf16", accelerator="cpu", env=cli, machine=CPU).precision.name == "bf16-mixed"
    assert lite.resolve(precision=32, accelerator="cpu", env=cli, machine=CPU).precision.name == "bf16-mixed"
    assert (
        lite.resolve(accelerator="cpu", env={"SCOPEDLITE_CLI_PRECISION": "bf16"}, machine=CPU).precision.name
        == "bf16-mixed"
    )
    with pytest.raises(ValueError, match=re.escape("launch(precision=64) in the script contradicts")):
        lite.resolve(precision=64, accelerator="cpu", env=cli, machine=CPU)
