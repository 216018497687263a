"""One script, every strategy: the set-up model is the user's model (SPEC section 7).

``tests/scripts/one_script.py`` runs unchanged under single, ddp, fsdp and DeepSpeed ZeRO 1-3
on 2 CPU ranks (gloo) and reports what it saw; each run is compared with one process training
the same model on whole batches with plain torch (``_reference`` below). The numbers are the
outputs of the user's methods and the parameters after folds, accumulation, clipping and a
checkpoint round trip, so a strategy that dropped a micro-batch, clipped differently or
restored the wrong state differs by far more than the 1e-5 allowed (a skipped accumulation
boundary under ZeRO 1/2 gave 1e-2).

The same runs count the reducing collectives of each backward of the accumulation (torch's
profiler sees every ``c10d`` op): none inside ``lite.no_backward_sync`` under ddp, fsdp and
ZeRO-1, some after it; ZeRO-2 and -3 reduce in every backward (documented in
docs/strategies.md: there it only makes the gradients add up).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_warm

SCRIPT = Path(__file__).resolve().parent / "scripts" / "one_script.py"
sys.path.insert(0, str(SCRIPT.parent))
from _common import assert_close, max_diff  # noqa: E402
from _one_script_common import build, global_batch, loss_of, probe, sgd  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install scopedlite[deepspeed])"
)
# The first DeepSpeed launch on a machine pays the one-time gcc build of its op.
TIMEOUT = 420

# What type() and isinstance(model, Net) give for the set-up model (docs/strategies.md).
TYPES = {
    "single": ("Net", True),
    "ddp": ("SetUpDDP", False),
    "fsdp": ("FSDPNet", True),
    "deepspeed": ("SetUpDeepSpeedEngine", False),
}
COMPARED = [
    "features_no_grad",
    "score_no_grad",
    "features_grad",
    "plain_score",
    "folds",
    "after_accumulation",
    "norms",
    "after_clip_norm",
    "after_clip_value",
    "model_a",
    "model_b",
    "after_resume",
]


def _run(strategy: str, directory: Path) -> dict:
    result = run_warm(SCRIPT, strategy, directory, tmp_path=directory, timeout=TIMEOUT - 20, cwd=directory)
    assert result.returncode == 0, (
        f"{strategy}: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return result.json()


def _flat(model: torch.nn.Module) -> dict[str, list[float]]:
    return {k: v.float().flatten().tolist() for k, v in sorted(model.state_dict().items())}


@functools.cache
def _reference() -> dict:
    """What one process computes with plain torch on the whole batch of 8 rows per step, in
    the script's order (2 ranks of 4 rows average to the same gradients)."""
    out: dict = {}

    def train(model, opt, steps, start, accumulate=False, max_norm=None, clip_val=None):
        norms = []
        for step in range(start, start + steps):
            x, y = global_batch(step)
            if accumulate:  # two micro-batches, each its mean loss, gradients added up
                loss_of(model, x[:4], y[:4]).backward()
                loss_of(model, x[4:], y[4:]).backward()
            else:
                loss_of(model, x, y).backward()
            if max_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            if clip_val is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_val)
            opt.step()
            opt.zero_grad()
        return norms

    model = build(0)
    opt = sgd(model)
    with torch.no_grad():
        out["features_no_grad"] = model.features(probe()).flatten().tolist()
        out["score_no_grad"] = out["plain_score"] = model.score(probe()).flatten().tolist()
    out["features_grad"] = out["features_no_grad"]
    out["folds"] = []
    for fold in range(2):
        fold_model = build(10 + fold)
        train(fold_model, sgd(fold_model), steps=2, start=10 * fold)
        out["folds"].append(_flat(fold_model))
    train(model, opt, steps=2, start=20, accumulate=True)
    out["after_accumulation"] = _flat(model)
    out["norms"] = train(model, opt, steps=2, start=30, max_norm=0.05)
    out["after_clip_norm"] = _flat(model)
    train(model, opt, steps=2, start=40, clip_val=0.01)
    out["after_clip_value"] = _flat(model)
    model_a, model_b = build(20), build(21)
    x, y = global_batch(50)
    (loss_of(model_a, x, y) + loss_of(model_b, x, y)).backward()  # one loss through two models
    out["joint_grads"] = [
        [None if p.grad is None else p.grad.flatten().tolist() for p in m.parameters()] for m in (model_a, model_b)
    ]
    model_a.zero_grad()
    model_b.zero_grad()
    train(model_b, sgd(model_b), steps=1, start=51)
    train(model_a, sgd(model_a), steps=1, start=52)
    out["model_a"], out["model_b"] = _flat(model_a), _flat(model_b)
    train(model, opt, steps=1, start=60)
    out["after_resume"] = _flat(model)
    return out


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(
    "strategy",
    [
        "single",
        "ddp",
        "fsdp",
        pytest.param("deepspeed_stage_1", marks=needs_deepspeed),
        pytest.param("deepspeed_stage_2", marks=needs_deepspeed),
        pytest.param("deepspeed_stage_3", marks=needs_deepspeed),
    ],
)
def test_one_script_runs_unchanged_and_matches_one_process(strategy, tmp_path):
    result = _run(strategy, tmp_path)
    family = "deepspeed" if strategy.startswith("deepspeed") else strategy

    # The user's attribute and methods, on the set-up model.
    assert (result["type"], result["isinstance_user_class"]) == TYPES[family]
    assert result["gain"] == 0.5
    assert result["describe"] == "Net(gain=0.5)"
    assert result["gain_seen_inside"] == 0.25, "model.gain = ... must reach the module forward reads"
    assert "no_such_attribute" in result["missing_attribute"]

    # Plain keys that load strictly into Net() (the script loads them; the values agree).
    assert result["state_dict_keys"] == result["plain_keys"]
    assert "body.0.weight" in result["state_dict_keys"]
    if strategy in ("single", "ddp"):
        assert result["saved_keys"] == result["plain_keys"]

    # Folds: a new model each, the old one released (the model and its parameters).
    assert result["fold_0_released"] == [True, True]
    assert result["fold_1_released"] == [True, True]

    # Clipping by norm was active (the norm returned is above max_norm=0.05).
    assert min(result["norms"]) > 0.05

    # Checkpoint round trip into a freshly set-up model, then one step on each.
    assert result["loaded_equal"] is True
    assert result["loaded_rest"] == {"step": 7}
    assert max_diff(result["after_resume"], result["fresh_after_resume"]) == 0.0

    for key in COMPARED:
        assert_close(result[key], _reference()[key], 1e-5, f"{strategy}: {key}")

    # Accumulation: the backward inside no_backward_sync reduces nothing (but under ZeRO-2/3,
    # which reduce and partition gradients in every backward); the one after it reduces.
    inside, after = zip(*result["reductions"], strict=True)
    assert len(inside) == 2, result["reductions"]
    if strategy == "single":
        assert inside == after == (0, 0)
    else:
        assert min(after) > 0, result["reductions"]
        if strategy in ("deepspeed_stage_2", "deepspeed_stage_3"):
            assert min(inside) > 0, result["reductions"]
        else:
            assert inside == (0, 0), f"{strategy}: collectives inside no_backward_sync: {result['reductions']}"

    if family == "deepspeed":
        # One engine per model: a loss of two trained models needs model=..., said so.
        assert "lite.backward(loss, model=model)" in result["ambiguous_backward"]
        assert "takes a model returned by lite.setup in this run, got a Net" in result["backward_plain_model"]
    else:
        assert result["ambiguous_backward"] == "no error"
        assert result["backward_plain_model"] == "no error"
        # that backward, through two set-up models (a GAN's generator step through its
        # discriminator is one), gave each model plain torch's gradients on the whole batch
        _check_joint_grads(result["joint_grads"], _reference()["joint_grads"], strategy)
    # The user's `config` is the user's under every strategy, though a DeepSpeed engine has a
    # `config` of its own (DeepSpeed reaches that one on the engine itself); nothing to warn.
    assert result["config_is_users"] is True
    assert result["shadow_warnings"] == []
    if strategy in ("deepspeed_stage_1", "deepspeed_stage_2"):
        # ZeRO 1/2 would keep only the second backward's gradients: refused, with the fix.
        assert "lite.no_backward_sync(model)" in result["second_backward"]
        assert "without an optimizer is not available under ZeRO stage" in result["setup_without_optimizer"]
    else:
        assert result["second_backward"] == "no error"
        assert result["setup_without_optimizer"] == "no error"


def test_backward_refuses_a_model_that_is_not_a_module():
    import torch

    import scopedlite as lite

    loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum()
    with pytest.raises(
        TypeError, match=r"lite.backward\(loss, model=...\) takes the model returned by lite.setup, got str"
    ):
        lite.backward(loss, model="generator")


def test_the_user_methods_are_the_ones_the_users_classes_define():
    import torch

    from scopedlite._strategies.user_model import user_method_names

    class Base(torch.nn.Module):
        def encode(self, x):
            return x

    class Net(Base, torch.nn.Sequential):
        def forward(self, x):
            return x

        def generate(self, x):
            return x

        @staticmethod
        def helper():
            return 1

        @property
        def size(self):
            return 1

    names = user_method_names(Net)
    assert sorted(names) == ["encode", "generate"]  # not forward, torch's, static or property


@pytest.mark.timeout(120)
def test_a_method_of_an_fsdp_unit_gathers_and_trains_as_one_process(script):
    from unit_methods import Net, Stack, rank_batch, step_loss

    result = script("unit_methods", "fsdp", timeout=100)
    assert result.returncode == 0, result.explain()
    # one process: each step the mean of the 2 ranks' losses, then SGD
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = [rank_batch(rank) for rank in range(2)]
    for _ in range(2):
        (sum(step_loss(net, x) for x in xs) / 2).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        expected = torch.cat([net.block.attend(x) for x in xs]).flatten().tolist()
    out = result.json()
    assert_close(out["outputs"], expected, 1e-6, "the method's outputs after training")
    # FSDP2's class names (its classes with our view mixed in), the user's classes kept; a
    # container indexed into builds the user's class, as under FSDP2 alone
    assert out["classes"] == ["FSDPNet", True, "FSDPBlock", True]
    assert out["sliced"] == ["Stack", 1], "stack[:1]: its class, and how many times its __init__ ran"
    torch.manual_seed(1)
    stack = Stack(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        expected_first = torch.cat([stack.first(x) for x in xs]).flatten().tolist()
    assert_close(out["first"], expected_first, 1e-6, "a method of a set-up Sequential")


def _check_joint_grads(got, expected, strategy):
    assert len(got) == len(expected) == 2
    for m, (got_model, expected_model) in enumerate(zip(got, expected)):
        assert [g is None for g in got_model] == [e is None for e in expected_model], (
            f"{strategy}: model {m}: which gradients exist"
        )
        assert any(e is not None for e in expected_model)
        for k, (g, e) in enumerate(zip(got_model, expected_model)):
            if e is not None:
                assert_close(g, e, 1e-5, f"{strategy}: model {m}, parameter {k}: gradient")
