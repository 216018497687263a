"""A forward of the set-up model on rank 0 alone (evaluation after training, as nanoGPT and the
DDP tutorial do): exact under ddp, refused at once under the sharded strategies; never a hang.

Each launch runs with ``timeout=30``: a forward that waits for a rank that never comes fails
the run (and this test) instead of hanging it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import assert_close, make_data, make_model
from one_rank_forward import BATCH, STEPS, bn_model, eval_rows
from scopedlite._strategies.fsdp.strategy import FULL_WEIGHTS

pytestmark = pytest.mark.timeout(150)


def _rank_rows(step: int, rank: int) -> slice:
    return slice(step * BATCH + rank, (step + 1) * BATCH, 2)


def _ddp_reference() -> dict:
    """torch's DDP with BatchNorm, replayed with two plain replicas in one process: a forward
    that follows a training forward starts from rank 0's buffers; gradients are averaged."""
    x, y = make_data(BATCH * (STEPS + 1)).tensors
    replicas = [bn_model(), bn_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]

    def sync_buffers() -> None:
        for mine, rank0 in zip(replicas[1].buffers(), replicas[0].buffers()):
            mine.copy_(rank0)

    def train(step: int) -> None:
        grads = []
        for rank, (model, opt) in enumerate(zip(replicas, opts)):
            opt.zero_grad()
            rows = _rank_rows(step, rank)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for model, opt in zip(replicas, opts):
            for p, g0, g1 in zip(model.parameters(), *grads):
                p.grad = (g0 + g1) / 2
            opt.step()

    def evaluate(model: torch.nn.Module) -> list[float]:
        model.eval()
        with torch.no_grad():
            result = model(eval_rows()).flatten().tolist()
        model.train()
        return result

    with torch.no_grad():
        sync_buffers()  # DDP's construction broadcasts rank 0's state
    for step in range(STEPS):
        with torch.no_grad():
            sync_buffers()  # each training forward after the first one follows a training forward
        train(step)
    with torch.no_grad():
        sync_buffers()  # the evaluation follows a training forward
    every_rank = [evaluate(m) for m in replicas]
    train(STEPS)  # follows an evaluation (no grad): no buffer broadcast before it
    return {
        "every_rank": every_rank,
        "params": [p.detach().flatten().tolist() for p in replicas[0].parameters()],
        "rank0_alone": evaluate(replicas[0]),  # rank 0's own buffers: DDP would take rank 0's
    }


def test_ddp_rank_zero_evaluates_alone_and_every_rank_sees_rank_zeros_buffers(script):
    result = script("one_rank_forward", "ddp")
    assert result.returncode == 0, result.explain()
    out, expected = result.json(), _ddp_reference()
    assert_close(out["every_rank"], expected["every_rank"], 1e-5, "evaluation on every rank")
    assert_close(out["params"], expected["params"], 1e-5, "parameters after the 4th step")
    assert_close(out["rank0_alone"], expected["rank0_alone"], 1e-5, "rank 0's evaluation alone")
    assert_close(out["rank0_alone_with_grad"], expected["rank0_alone"], 1e-5, "rank 0's evaluation alone, grad on")


def _plain_reference() -> tuple[list[float], list[float]]:
    """One process on the global batch: the evaluation after 3 steps, and after 4."""
    x, y = make_data(BATCH * (STEPS + 1)).tensors
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def evaluate() -> list[float]:
        with torch.no_grad():
            return model.eval()(eval_rows()).flatten().tolist()

    evaluations = []
    for step in range(STEPS + 1):
        if step == STEPS:
            evaluations.append(evaluate())
        model.train()
        opt.zero_grad()
        torch.nn.functional.mse_loss(
            model(x[step * BATCH : (step + 1) * BATCH]), y[step * BATCH : (step + 1) * BATCH]
        ).backward()
        opt.step()
    evaluations.append(evaluate())
    return evaluations[0], evaluations[1]


SHARDED = [
    "fsdp",
    "model_parallel",
    "model_parallel_tp",
    pytest.param(
        "deepspeed_stage_3",
        marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"),
    ),
]


@pytest.mark.parametrize("strategy", SHARDED)
def test_a_sharded_forward_on_some_ranks_is_refused_at_once_with_the_fix(script, strategy):
    result = script("one_rank_forward", strategy)
    assert result.returncode == 0, result.explain()
    out = result.json()
    after_three, after_four = _plain_reference()
    assert_close(out["every_rank"], [after_three, after_three], 1e-5, "evaluation on every rank")
    for case, what in [
        ("while_training", "rank 1 went on to the model's forward"),
        ("while_in_barrier", "rank 1 waits in a collective"),
        ("after_the_others_left", "rank 1 reached the end of its launch block"),
    ]:
        message = out[case]
        assert message.startswith("ForwardOnSomeRanksError: A forward of the set-up model in evaluation"), message
        assert "ran on rank(s) [0] only" in message and what in message, message
        named = strategy.removesuffix("_tp")
        assert f"strategy={named!r}" in message and "lite.join(model)" in message, message
        full = "model.state_dict()" if strategy == "deepspeed_stage_3" else FULL_WEIGHTS
        assert f"`weights = {full}` on every rank" in message, message
    if strategy == "deepspeed_stage_3":  # rank 0 alone saving its weights: refused before it gathers
        message = out["state_dict_alone"]
        assert message.startswith("MethodCalledOnSomeRanksError: Sequential.state_dict() needs the parameters"), message
        assert "only rank(s) [0] called it (rank 1 waits in a collective" in message, message
    for loaded in out["plain_file"]:  # rank 0's torch.save(model.state_dict()), loaded on every rank
        if strategy == "deepspeed_stage_3":  # gathered: the whole model
            assert loaded == "loaded", loaded
        else:  # DTensors: rank 0's shards only, refused rather than loaded half-wrong
            assert loaded.startswith("CheckpointError: plain_state.pt holds DTensors"), loaded
            assert "`full = {k: v.full_tensor() for k, v in model.state_dict().items()}`" in loaded, loaded
    # the fix it names: a plain copy from model.state_dict(), evaluated on rank 0 alone
    assert_close(out["plain_copy"], after_four, 1e-5, "rank 0's plain copy")
