"""DeepSpeed ZeRO 1-3 on 2 real CPU ranks (gloo), against one process training with plain torch.

Needs the ``deepspeed`` extra; skipped where it is not installed. DeepSpeed's shared-memory op
is JIT-built with gcc once per machine (about 1-2 minutes) by tests/conftest.py before the
first test marked ``deepspeed_op`` runs, outside the per-test timeouts; a launch then takes
seconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import scopedlite as lite

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import (
    assert_close,
    check_save_on_some_ranks,
    check_scheduler_on_some_ranks,
    check_skip_on_gathering,
    make_data,
    make_model,
    max_diff,
    reference_training,
)

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install scopedlite[deepspeed])"
)
# A run of 2 ranks on 2 busy cores; the op is built before the tests (tests/conftest.py).
RUN_S = 150


# -- configuration: no processes, no deepspeed needed -------------------------------------
def test_the_names_are_registered_with_their_stage_and_offloads():
    from scopedlite._strategies.registry import STRATEGIES

    expected = {
        "deepspeed": (2, False, False),
        "deepspeed_stage_1": (1, False, False),
        "deepspeed_stage_2": (2, False, False),
        "deepspeed_stage_3": (3, False, False),
        "deepspeed_stage_2_offload": (2, True, False),
        "deepspeed_stage_3_offload": (3, True, True),
    }
    for name, (stage, offload_opt, offload_params) in expected.items():
        strategy = STRATEGIES[name]()
        assert isinstance(strategy, lite.DeepSpeedStrategy)
        assert (strategy.stage, strategy.offload_optimizer, strategy.offload_parameters) == (
            stage,
            offload_opt,
            offload_params,
        )


@needs_deepspeed
def test_resolving_a_deepspeed_strategy_does_not_import_deepspeed(run_python):
    result = run_python(
        "-c",
        "import sys, scopedlite as lite; s = lite.DeepSpeedStrategy(stage=3); "
        "lite.resolve(strategy=s, devices=2, accelerator='cpu', env={}, machine=lite.Machine()); "
        "print('deepspeed' in sys.modules)",
    )
    assert result.returncode == 0, result.explain()
    assert result.stdout.strip() == "False"


def test_missing_deepspeed_is_refused_before_anything_starts_naming_the_extra(run_python):
    code = (
        "import sys; sys.modules['deepspeed'] = None  # as if not installed\n"
        "import scopedlite as lite\n"
        "try:\n"
        "    lite.resolve(strategy='deepspeed_stage_3', devices=2, accelerator='cpu', env={}, "
        "machine=lite.Machine())\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.explain()
    assert "pip install scopedlite[deepspeed]" in result.stdout


def test_precision_maps_into_the_config():
    strategy = lite.DeepSpeedStrategy(stage=3, config={"bf16": {"enabled": True}, "train_batch_size": 8})
    config = strategy.build_config("bf16-mixed", "cpu")
    assert config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["stage"] == 3
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's own default (1.0) would clip
    assert "train_micro_batch_size_per_gpu" not in config  # the user's batch size is kept
    assert "fp16" not in lite.DeepSpeedStrategy().build_config("bf16-true", "cpu")
    assert "bf16" not in lite.DeepSpeedStrategy().build_config("32-true", "cpu")
    offload = lite.DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    zero = offload.build_config("32-true", "cpu")["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"


def test_the_config_file_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}')
    strategy = lite.DeepSpeedStrategy(config=str(path))
    assert strategy.stage == 1
    assert strategy.build_config("32-true", "cpu")["gradient_clipping"] == 0.5


@pytest.mark.parametrize(
    "kwargs, precision, match",
    [
        ({"stage": 5}, "32-true", r"stage=5 is not a ZeRO stage.*\(0, 1, 2, 3\)"),
        ({"stage": 2, "config": {"zero_optimization": {"stage": 3}}}, "32-true", r"stage=2\) contradicts"),
        ({"config": {"fp16": {"enabled": True}}}, "bf16-mixed", r"enables 'fp16' but launch\(precision='bf16-mixed'\)"),
        ({"config": {"bf16": {"enabled": True}}}, "32-true", r"enables 'bf16'.*precision='bf16-mixed'"),
        ({"stage": 2, "offload_parameters": True}, "32-true", r"offload_parameters=True needs ZeRO stage 3"),
        (
            {"offload_optimizer": False, "config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}},
            "32-true",
            r"offload_optimizer=False\) contradicts",
        ),
        ({}, "64-true", r"precision='64-true' is not supported by DeepSpeed"),
        ({}, "16-true", r"fp16 loss scaling is not supported on CPU.*bf16-mixed"),
    ],
)
def test_contradictions_are_refused_before_anything_starts(kwargs, precision, match):
    with pytest.raises(ValueError, match=match):
        lite.resolve(
            strategy=lite.DeepSpeedStrategy(**kwargs),
            devices=2,
            accelerator="cpu",
            precision=precision,
            env={},
            machine=lite.Machine(),
        )


def test_a_config_that_is_not_a_dict_or_file_is_refused(tmp_path):
    with pytest.raises(TypeError, match="takes a dict or the path of a JSON file"):
        lite.DeepSpeedStrategy(config=3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="no such JSON file"):
        lite.DeepSpeedStrategy(config=str(tmp_path / "missing.json"))


# -- the op's build folder ------------------------------------------------------------------
def test_a_stale_build_lock_is_cleared_and_a_held_one_is_kept(tmp_path):
    import subprocess

    from conftest import clear_stale_build_locks

    (tmp_path / "left_by_a_killed_build").mkdir()
    stale = tmp_path / "left_by_a_killed_build" / "lock"
    stale.touch()
    (tmp_path / "building_now").mkdir()
    held = tmp_path / "building_now" / "lock"
    # a build in progress: torch's FileBaton keeps its lock file open until it is done
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, sys, time; os.open({str(held)!r}, os.O_CREAT | os.O_EXCL); "
            "print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"1"
        assert clear_stale_build_locks(tmp_path) == [stale]
        assert not stale.exists() and held.exists()
    finally:
        holder.kill()
        holder.wait()


def test_every_test_file_shares_one_extension_folder(run_python):
    import os

    from conftest import EXTENSIONS_DIR

    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(EXTENSIONS_DIR)
    result = run_python("-c", "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])")
    assert result.stdout.strip() == str(EXTENSIONS_DIR)


# -- real runs: 2 ranks, gloo --------------------------------------------------------------
@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
@pytest.mark.parametrize(
    "strategy, accumulate",
    [
        ("deepspeed_stage_1", False),
        ("deepspeed_stage_2", False),
        ("deepspeed_stage_3", False),
        # 2 micro-batches of 2 through the engine's gradient_accumulation_steps = one batch of 4
        ("deepspeed_stage_3_offload", True),
    ],
)
def test_zero_trains_like_one_process_on_the_same_data(script, strategy, accumulate):
    n, batch = 24, 4
    extra = ("32-true", "accumulate") if accumulate else ()
    result = script("deepspeed_train", strategy, n, batch, *extra, timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    out = result.json()
    assert out["engine"] == "SetUpDeepSpeedEngine" and out["optimizer"] == "SGD"
    assert out["stage"] == int(strategy.split("_")[2])
    reference = reference_training(n, 2, batch)
    expected = [p.detach().flatten().tolist() for p in reference.parameters()]
    assert_close(out["params"], expected, 1e-5, "parameters")
    with torch.no_grad():
        expected_out = reference(make_data(6, seed=5).tensors[0]).flatten().tolist()
    assert_close(out["outputs"], expected_out, 1e-5, "outputs")
    rows = out["first_param_on_each_rank"]
    assert rows[0] == rows[1]  # our all_gather, beside DeepSpeed, on its process group
    assert out["broadcast"] == {"rank": 1}
    # lite.all_reduce(mean) of the first step: the loss of both ranks' first batches
    x, y = make_data(n).tensors
    micro = batch // 2 if accumulate else batch
    with torch.no_grad():
        first = [
            torch.nn.functional.mse_loss(make_model()(x[r : r + 2 * micro : 2]), y[r : r + 2 * micro : 2])
            for r in (0, 1)
        ]
    assert out["means"][0] == pytest.approx(float(sum(first)) / 2, rel=1e-5)
    assert len(out["means"]) == n // 2 // micro and out["means"][-1] < out["means"][0]
    # DeepSpeed's noise stays out: its INFO logs and its "built successfully" print
    assert "[INFO]" not in result.stdout + result.stderr
    assert "built successfully" not in result.stdout
    if not accumulate:
        _check_resume_and_join_refusals(out)


def _check_resume_and_join_refusals(out):
    """deepspeed_train.py after its training: saved after 3 of 8 steps of a shuffled pass with
    dropout and momentum, loaded, the pass continues with the same losses and outputs to the
    last bit; and the join refusals of this stage, on every rank, the session usable after."""
    if out["stage"] == 1:  # ZeRO-1 and 2 share DeepSpeed's checkpoint code: resumed under 2 and 3
        assert "resume" not in out
    else:
        _check_resume(out["resume"])
    if out["stage"] == 3:  # tests/test_join.py checks ZeRO-3's refusals
        assert "join_refusals" not in out
        return
    assert len(out["join_refusals"]) == 2
    for errors in out["join_refusals"]:  # every rank raised, together: nobody hangs
        assert errors["lr_by_hand"].startswith("RuntimeError") and "changed from 0.1 to 0.5" in errors["lr_by_hand"]
        assert errors["disagree"].startswith("RuntimeError") and "announced different steps" in errors["disagree"]
        assert errors["plateau"].startswith("RuntimeError") and "ReduceLROnPlateau" in errors["plateau"]
        assert (
            errors["two_forwards"].startswith("RuntimeError")
            and "loss built from several forwards" in errors["two_forwards"]
        )
        assert errors["after"] == 2


def _check_resume(resume):
    assert resume["steps"] == 8
    assert resume["resumed"] == resume["reference"], "the resumed pass differs from the uninterrupted one"
    assert all(0 < loss < 10 for loss in resume["reference"][0]), resume  # finite, training: == can fail
    assert len(resume["resumed"][0]) == 5  # the 5 batches not yet seen, no more


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
def test_bf16_mixed_trains_the_model_in_bf16(script):
    n, batch = 24, 4
    result = script("deepspeed_train", "deepspeed_stage_2", n, batch, "bf16-mixed", timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    out = result.json()
    assert out["param_dtype"] == "torch.bfloat16"
    reference = reference_training(n, 2, batch)
    expected = [p.detach().flatten().tolist() for p in reference.parameters()]
    assert_close(out["params"], expected, 2e-2, "parameters")  # bf16 forward/backward, fp32 master weights


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
def test_zero3_sharded_init_checkpoint_and_refusals(script, tmp_path):
    result = script("deepspeed_zero3", tmp_path / "ckpt", timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    out = result.json()

    # Built inside sharded_init in the run's dtype on every rank (float32 for "32-true").
    assert out["dtypes"] == ["torch.float32"]
    assert out["float32_on_every_rank"] == [True, True]
    # Built inside sharded_init: each rank holds half of every parameter, never the whole.
    full = sum(s["full"] for s in out["shards"])
    assert full == 32 * 64 + 64 + 64 * 64 + 64 + 64 + 1
    for shard in out["shards"]:
        assert shard["materialised"] == 0
        assert shard["local"] == -(-shard["full"] // 2)
    assert abs(out["sum_local"] - full) <= len(out["shards"])  # the halves add up to the model
    # ... and the values are those of the same model built in one process
    import torch.nn as nn

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    assert max_diff(out["built"], [p.detach().flatten().tolist() for p in plain.parameters()]) == 0.0

    # save -> train on -> load restores outputs exactly, and the optimizer (momentum) too
    assert out["moved"] != out["at_save"]
    assert out["at_load"] == out["at_save"]
    assert out["after_one_again"] == out["after_one"] != out["at_save"]
    assert out["step"] == 3 and out["rest"] == {"note": "hello"}
    assert out["env_restored"]
    assert out["leftovers"] == ["ckpt"]  # saved again over it: no temporary folder left
    # the evaluation engine (set up without an optimizer, gathered by ZeRO-3 for its forward):
    # on every rank the outputs of the same model built in one process
    assert out["evaluator"] == "SetUpDeepSpeedEngine"
    torch.manual_seed(0)
    evaluator = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    probe = torch.randn(5, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = evaluator(probe).flatten().tolist()
    assert_close(out["evaluated"], [expected, expected], 1e-6, "the evaluation engine's outputs on each rank")
    # one fp32 state dict, loaded into the plain model, gives the same outputs
    assert out["consolidated_keys"] == sorted(plain.state_dict())
    assert_close(out["consolidated"], out["at_save"], 1e-6, "the consolidated model's outputs")

    refusals = out["refusals"]
    assert refusals["join"].startswith("ValueError") and "not both at once" in refusals["join"]
    assert "lite.setup(model, opt)" in refusals["setup_optimizers"]


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_a_scheduler_stepped_on_one_rank_is_refused_at_the_next_backward(script, strategy):
    """First rank 1 alone calls opt.step() with no backward since its last step: refused at
    once there (DeepSpeed failed inside with a TypeError), the ranks still in step. Then, as
    under ddp (test_ddp.py): a scheduler stepped on rank 0 alone is refused at the next
    lite.backward on every rank, before the engines step their partitions with different
    rates; the digest of the optimizers the engines stepped rides on the forward counts'
    all-reduce. The correct part before it (a dropped model rank 1 still holds, a join block)
    equals plain torch."""
    result = script("scheduler_on_some_ranks", strategy, "step-alone,scheduler", timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    check_scheduler_on_some_ranks(result.json(), "step-alone,scheduler")


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_a_step_skipped_on_one_rank_is_refused_on_every_rank_at_once(script, strategy):
    """Outside lite.join, rank 1 skips a step (`if not torch.isfinite(loss): continue`): each
    rank raises in its next lite.backward (rank 0's 4th batch, rank 1's 5th), before the
    engine steps with gradients reduced across different steps (before: the ranks went on
    silently with mixed gradients and hung at the next collective of another size); the
    next collective pairs. Even steps train as plain torch does, with rank 0
    evaluating alone under no_grad in between, and an uneven join block restarts the counts,
    as does one that every rank leaves by a refusal (caught). The same with DeepSpeed's own
    model.backward(loss) and model.step(). Not the skip at stage 3, whose forwards gather: the
    skipping rank's next forward is refused and the run ends (the next test)."""
    result = script("skipped_step", strategy, timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    seen = result.json()
    for rank, out in enumerate(seen):
        assert_close(out["hooked"], out["reference"], 1e-5, f"rank {rank} params")
        assert out["after_join"]
        # refused inside a join block on every rank, caught: the check of outside it goes on
        assert "announced different steps" in out["join_refused"], out["join_refused"]
        assert out["after"] == 3.0
        assert_close(out["native"], out["native_reference"], 1e-5, f"rank {rank} params (model.backward)")
        assert out["native_after"] == 3.0
    if strategy == "deepspeed_stage_3":  # the skip ends the run there: the test after this one
        return
    for out in seen:
        assert "different numbers of training forwards" in out["error"], out["error"]
        assert "DeepSpeed would reduce gradients of different steps" in out["error"], out["error"]
        assert "lite.all_reduce(float(not torch.isfinite(loss))" in out["error"], out["error"]
        assert "different numbers of training forwards" in out["native_error"], out["native_error"]
    assert [out["at"] for out in seen] == [3, 4]
    assert [out["native_at"] for out in seen] == [3, 4]


def _clipped_reference(clip):
    """Plain torch, one process, on deepspeed_torch_clip.py's data: each step the mean of the
    two ranks' losses, then ``clip``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generators = [torch.Generator().manual_seed(20 + r) for r in (0, 1)]
    data, returned = [[torch.randn(4, 4, generator=g) * 3 for _ in range(3)] for g in generators], []
    for step in range(3):
        (sum(model(data[r][step]).pow(2).mean() for r in (0, 1)) / 2).backward()
        returned.append(clip(model))
        opt.step()
        opt.zero_grad()
    return [p.detach().flatten().tolist() for p in model.parameters()], returned


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_torch_clip_grad_norm_on_a_deepspeed_model_clips_the_engines_gradients(script, strategy):
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` after lite.backward, as a
    DDP script (nanoGPT) writes it: under DeepSpeed every .grad is None, so torch clipped
    nothing and returned 0.0, silently. It now clips the engine's full gradients: the returned
    norms and the parameters equal plain torch's, for clip_grad_value_ too. Part of the
    parameters is refused, and so is the call inside lite.join (on every rank at once), and a
    clip on rank 0 alone (torch's or lite's), at once, with the training unchanged."""
    result = script("deepspeed_torch_clip", strategy, timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    seen = result.json()
    expected, norms = _clipped_reference(lambda m: float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
    assert all(n > 0.05 for n in norms)  # every step clips: a test that can fail
    by_value, _ = _clipped_reference(lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01))
    for rank, out in enumerate(seen):
        assert_close(out["norm"]["params"], expected, 1e-5, f"rank {rank} params (clip_grad_norm_)")
        assert_close(out["norm"]["returned"], norms, 1e-5, f"rank {rank} returned norms")
        assert_close(out["value"]["params"], by_value, 1e-5, f"rank {rank} params (clip_grad_value_)")
        assert out["value"]["returned"] == [None, None, None]
        assert "but not all it trains" in out["part"], out["part"]
        assert "lite.clip_gradients(model, optimizer, max_norm=...)" in out["join"], out["join"]
        assert out["after"] == 3.0
    alone = seen[0]["alone"]  # rank 0 clipped alone: refused at once, the training unchanged
    assert set(alone) == {"torch", "lite"}, alone
    assert alone["torch"].startswith("torch.nn.utils.clip_grad_norm_() was called on rank(s) [0] only"), alone
    assert alone["lite"].startswith("lite.clip_gradients() was called on rank(s) [0] only"), alone
    for message in alone.values():
        assert "(rank 1 went on to optimizer.step(), a collective here)" in message, message
        assert "Clip on every rank, then use the" in message, message
    assert seen[1]["alone"] == {}


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_lite_save_or_load_on_rank_zero_alone_is_refused_at_once(script, strategy):
    """As under fsdp (test_fsdp.py) and ddp: at stage 3 every rank writes its part of the
    folder, at stages 1-2 the ranks check the path together; rank 0 alone is refused at once,
    before any collective (before: at stages 1-2 gloo aborted the process on the mismatched
    sizes); the ranks stay in step."""
    result = script("save_on_some_ranks", strategy, timeout=RUN_S)
    assert result.returncode == 0, result.explain()
    check_save_on_some_ranks(result.json())


@needs_deepspeed
@pytest.mark.deepspeed_op
@pytest.mark.timeout(RUN_S + 30)
def test_a_backward_skipped_on_one_rank_is_refused_at_its_next_forward_at_stage_3(script):
    """As under fsdp (test_fsdp.py): at stage 3 a forward gathers, and the forward after a
    backward skipped on rank 1 is refused at once; the run ends with that refusal."""
    result = script("skip_on_gathering", "deepspeed_stage_3", timeout=RUN_S)
    check_skip_on_gathering(result)
