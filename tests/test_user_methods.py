"""The user's own methods called on some ranks or all (issue 29), against plain-torch references.

``tests/scripts/user_methods.py`` runs once per strategy on 2 CPU ranks (gloo) and checks
many things in that one launch (see its docstring). Here the numbers it reports are compared
with one-process references computed with plain torch:

- ddp, the minimal form: rank 0 alone (or every rank) calls ``num_params()`` and a forward-
  running ``score(x)`` between steps of 2-micro-batch accumulation: the parameters equal the
  reference on every rank, and DDP's comm hook counts no all-reduce inside
  ``no_backward_sync`` and one per step (the bug: rank 0 all-reduced inside it, then hung). The
  same with the loss computed by a method, and with forward's and a method's loss summed.
- nanoGPT's loop (``estimate_mfu`` on rank 0 alone, clipping by norm at 0.3, active at
  every step), under ddp, fsdp and deepspeed stage 2, plainly and inside ``lite.join``: the
  parameters and rank 0's logged losses equal the reference.
- fsdp and ZeRO-3: ``generate`` (it gathers) works on every rank, is refused on rank 0 alone
  (naming it and the ranks) and inside ``lite.join``, and the run goes on.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import nanogpt
from _common import NetWithMethods, assert_close, max_diff, micro_batch

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install scopedlite[deepspeed])"
)
WORLD, STEPS = 2, 3  # as in the script
RUN_S = 150  # a launch of 2 ranks on 2 busy cores (DeepSpeed: its op is built before the tests)


def _run(script, strategy: str) -> dict:
    result = script("user_methods", strategy, timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    return result.json()


def _state(reference: torch.nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().flatten().tolist() for k, v in reference.state_dict().items()}


# -- the minimal form under DDP --------------------------------------------------------------
def _minimal_reference() -> torch.nn.Module:
    """One process: each step, the gradients summed over both micro-batches of each rank and
    averaged over the ranks (what DDP with no_sync accumulation computes), then SGD."""
    torch.manual_seed(0)
    net = NetWithMethods()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        for rank in range(WORLD):
            for micro in range(2):
                x, y = micro_batch(step, rank, micro)
                (torch.nn.functional.mse_loss(net(x), y) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return net


@pytest.mark.timeout(RUN_S + 30)
def test_ddp_methods_on_some_ranks_change_no_collective(script):
    result = _run(script, "ddp")
    reference = _minimal_reference()
    n_params = sum(p.numel() for p in reference.parameters())
    assert sorted(result["ddp"]) == ["all", "method_loss", "mixed", "rank0"]
    for phase, seen in result["ddp"].items():
        assert seen["same"], f"{phase}: parameters differ between the ranks"
        assert_close(seen["params"], _state(reference), 1e-6, phase)
        # per micro-step: none inside no_backward_sync, one (a single bucket) after it
        assert seen["all_reduces"] == [0, 1] * STEPS, phase
    assert result["ddp"]["rank0"]["counted"] == [n_params] * STEPS  # rank 0's own calls
    assert result["ddp"]["all"]["counted"] == [n_params] * STEPS
    joined = result["ddp_join"]
    assert joined["message"].startswith(
        "Inside lite.join the result of the model's own method NetWithMethods.loss() was back-propagated"
    ), joined["message"]
    assert joined["same"]
    assert_close(joined["params"], _state(_one_step_reference()), 1e-6, "the joined step")
    _check_nanogpt(result, tolerance=1e-5)


def _one_step_reference() -> torch.nn.Module:
    """One SGD step on both ranks' first micro-batch of step 0, averaged."""
    torch.manual_seed(0)
    net = NetWithMethods()
    for rank in range(WORLD):
        x, y = micro_batch(0, rank, 0)
        (torch.nn.functional.mse_loss(net(x), y) / WORLD).backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    return net


# -- nanoGPT's pattern -----------------------------------------------------------------------
def _nanogpt_reference(args) -> tuple[torch.nn.Module, list[float]]:
    """One process: nanoGPT's loop over both ranks' batches (each rank's own generator), the
    gradients averaged over the ranks, clipped, AdamW; and rank 0's logged losses."""
    model, optimizer = nanogpt.build(args)
    data = nanogpt.token_stream(4000)
    generators = [torch.Generator().manual_seed(1337 + r) for r in range(WORLD)]
    batches = [nanogpt.get_batch(data, g, args.batch_size, args.block_size) for g in generators]
    accumulate = args.gradient_accumulation_steps
    logged = []
    for _ in range(args.max_iters):
        for rank in range(WORLD):
            for _ in range(accumulate):
                x, y = batches[rank]
                _, loss = model(x, y)
                batches[rank] = nanogpt.get_batch(data, generators[rank], args.batch_size, args.block_size)
                (loss / accumulate / WORLD).backward()
                if rank == 0:
                    last = loss.item()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged.append(last)
    return model, logged


@functools.cache
def _nanogpt_run(clip: float) -> tuple[dict[str, list[float]], list[float]]:
    """The reference's parameters and logged losses, clipping at ``clip`` (0: none); computed
    once per session (seconds each), shared by the three strategies' tests."""
    args = nanogpt.arguments(["--max-iters", "7", "--gradient-accumulation-steps", "2", "--grad-clip", str(clip)])
    model, logged = _nanogpt_reference(args)
    return _state(model), logged


def _check_nanogpt(result: dict, tolerance: float) -> None:
    """The script's nanoGPT runs (clipping at 0.3: every step's norm is above it) against the reference."""
    reference, logged = _nanogpt_run(0.3)
    assert sorted(result["nanogpt"]) == ["join", "plain"]
    for where, seen in result["nanogpt"].items():
        assert seen["same"], f"{where}: parameters differ between the ranks"
        assert_close(seen["params"], reference, tolerance, where)
        assert_close(seen["losses"], logged, 1e-5, f"{where}: rank 0's logged losses")
    assert logged[-1] < logged[0] * 0.8, logged  # and it learns
    # clipping was active: without it the parameters end elsewhere (1.5e-2 away)
    assert max_diff(_nanogpt_run(0.0)[0], reference) > 100 * tolerance


@pytest.mark.timeout(RUN_S + 30)
def test_fsdp_methods_gather_only_when_needed_and_only_on_every_rank(script):
    result = _run(script, "fsdp")
    _check_nanogpt(result, tolerance=2e-5)
    _check_gathering(result["gathering"], "fsdp")


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
def test_deepspeed_stage_2_methods_on_rank_zero(script):
    result = _run(script, "deepspeed_stage_2")
    _check_nanogpt(result, tolerance=2e-5)


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
def test_deepspeed_stage_3_refuses_a_gathering_method_on_some_ranks(script):
    result = _run(script, "deepspeed_stage_3")
    _check_gathering(result["gathering"], "deepspeed_stage_3")


def _check_gathering(seen: dict, strategy: str) -> None:
    model, _ = nanogpt.build(nanogpt.arguments([]))
    # the whole model's counts (ZeRO-3 counted 0: its partitioned parameters hold no elements)
    assert seen["counted"] == sum(p.numel() for p in model.parameters()) > 0, seen["counted"]
    assert seen["num_params"] == model.get_num_params() > 0, seen["num_params"]
    assert seen["mfu"] == model.estimate_mfu(1, 1.0) > 0, seen["mfu"]
    expected = model.generate(torch.tensor([[1, 8, 11]]), 4).tolist()
    assert seen["every_rank"] == expected and seen["every_rank_same"]
    refusal = seen["rank0_alone"]
    assert refusal.startswith("MethodCalledOnSomeRanksError: GPT.generate() needs the parameters gathered"), refusal
    assert f"strategy={strategy!r}" in refusal and "only rank(s) [0] called it" in refusal, refusal
    assert "rank 1 went on to the model's forward" in refusal, refusal
    assert seen["in_join"].startswith("Inside lite.join, GPT.generate() needs the model's parameters gathered"), seen[
        "in_join"
    ]
    assert seen["same_after"]  # nothing was gathered: the ranks went on in step
