"""The run's registry of what it set up (``_strategies/set_up.py``), on real gloo processes.

State about objects that are not ours (the user's module and optimizer, torch's DDP module, a
DeepSpeed engine) lives with the run, weakly, and ends with it: several launch blocks forked
from one process, as a notebook runs them, each start with an empty registry, and once a block
has ended nothing of ours is left on any of those objects. Of the process-wide state
(``_core/process.py``) each block sees only what is its own.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from _common import make_model

pytestmark = pytest.mark.timeout(150)

_NEEDS_DEEPSPEED = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install scopedlite[deepspeed])",
)


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        "fsdp",
        pytest.param("deepspeed_stage_2", marks=_NEEDS_DEEPSPEED),
        pytest.param("deepspeed_stage_3", marks=_NEEDS_DEEPSPEED),
    ],
)
def test_each_block_owns_its_registry_and_leaves_nothing_on_what_it_set_up(script, strategy):
    result = script("set_up_ownership", strategy, timeout=120)
    assert result.returncode == 0, result.explain()
    blocks = result.json()
    assert len(blocks) == 3
    for number, block in enumerate(blocks, start=1):
        where = f"block {number} under {strategy}"
        for rank, seen in enumerate(block["during"]):
            assert seen["started_empty"], f"{where}, rank {rank}: the run's registry did not start empty"
            assert seen["models"] == [True], f"{where}, rank {rank}: the registry held {seen['models']}"
            assert seen["site_known"], f"{where}, rank {rank}: where the model was set up is not known"
            assert seen["scheduler_known"] and seen["torch_inits_wrapped"], f"{where}, rank {rank}: {seen}"
            assert seen["open_launches"] == 1 and not seen["stop_requested"], f"{where}, rank {rank}: {seen}"
            assert seen["blocks_entered"] == number, f"{where}, rank {rank}: {seen}"
            assert seen["holds_store"], f"{where}, rank {rank}: the run does not hold its own store"
        assert block["empty_after"], f"{where}: the registry still holds something after the block"
        assert block["torch_inits_after"], f"{where}: torch's LR scheduler classes were left wrapped"
        assert block["open_launches_after"] == 0 and not block["store_after"], f"{where}: {block}"
        assert block["ours_on_model"] == [], f"{where}: left on the set-up model: {block['ours_on_model']}"
        assert block["ours_on_user_module"] == [], f"{where}: left on the user's module: {block['ours_on_user_module']}"
        assert block["ours_on_optimizer"] == [], f"{where}: left on the optimizer: {block['ours_on_optimizer']}"


@pytest.mark.parametrize(
    "strategy",
    ["ddp", "fsdp", pytest.param("deepspeed_stage_3", marks=_NEEDS_DEEPSPEED)],
)
def test_an_optimizer_training_a_parameter_of_no_set_up_model_is_refused_on_every_rank(script, strategy):
    """A free-standing parameter in the loss, beside the model's: ValueError on every rank
    naming its shape and the fix (under ddp it was trained by each rank on its own, its
    gradient never averaged; DeepSpeed failed inside deepspeed.initialize); an optimizer over
    two models, the second set up after it, trains (its last bias moved: 0.1 * -2 rows);
    the run goes on."""
    result = script("foreign_parameters", strategy)
    assert result.returncode == 0, result.explain()
    reference = make_model(1)
    for out in result.json():
        message = out["free_parameter"]
        assert message is not None and "holds a parameter of shape ()" in message, out
        assert "torch.nn.Parameter(...)" in message and "lite.setup(model, opt)" in message, message
        if strategy == "ddp":
            assert "each rank would train its own copy" in message, message
        if "set_up_later" in out:
            assert out["set_up_later"] == pytest.approx(
                float(list(reference.parameters())[-1].detach().sum()) - 0.1 * 2
            )
        assert out["went_on"] == 2
