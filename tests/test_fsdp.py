"""FSDP (FSDP2, fully_shard) on 2 real gloo ranks: the DDP user's lines, sharded.

The scripts train with ``model, opt = lite.setup(model, Opt(model.parameters()))`` after
``lite.sharded_init()``; the test replays the same recipe in this process on one device with
plain torch and checks values that would differ if sharding, re-pointing the optimizer, the
replayed initialisation, clipping or checkpoints were wrong: the gathered parameters, and
each rank's own shards read on that rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import scopedlite as lite
from scopedlite._strategies.fsdp.hybrid import hsdp_shape

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import (
    assert_close,
    check_save_on_some_ranks,
    check_scheduler_on_some_ranks,
    check_skip_on_gathering,
    max_diff,
)
from _fsdp_common import (
    JOIN_BATCH,
    JOIN_BATCHES,
    JOIN_CLIP,
    JOIN_SEED,
    join_rows,
    make_data,
    make_net,
    make_optimizer,
    plain_run_state,
    probe,
    reference,
    step_after_plain_load,
)

pytestmark = pytest.mark.timeout(120)


def _flat(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _assert_sharded_like(
    local_params: list[list[list[float]]], model: torch.nn.Module, tol: float = 1e-5, shards: int = 2
) -> None:
    """Each rank holds its dim-0 chunk (``torch.chunk``, FSDP2's layout) of every parameter
    of ``model``, with the values of the one-process reference: read on each rank itself,
    not through a gather. With ``shards`` below the number of ranks (HSDP), rank ``r`` holds
    chunk ``r % shards``: every replica holds the whole model."""
    expected = [p.detach() for p in model.parameters()]
    assert len(local_params) in (2, 4), "one list of shards per rank"
    for rank, mine in enumerate(local_params):
        chunks = [torch.chunk(p, shards, dim=0) for p in expected]
        want = [c[rank % shards].flatten().tolist() if rank % shards < len(c) else [] for c in chunks]
        assert len(mine) == len(want), f"rank {rank}: {len(mine)} shards, expected {len(want)}"
        # a parameter of one row (the last bias) leaves a rank an empty shard: exactly empty
        held = [i for i, w in enumerate(want) if w]
        assert [mine[i] for i in range(len(want)) if i not in held] == [[]] * (len(want) - len(held)), rank
        assert_close([mine[i] for i in held], [want[i] for i in held], tol, f"rank {rank}'s shards")


def _run(script, *args) -> dict:
    result = script("fsdp_train", *args, timeout=100)
    assert result.returncode == 0, result.explain()
    return result.json()


@pytest.mark.timeout(100)
def test_sharded_init_equals_a_plain_build_halves_storage_and_trains_like_one_process(script, tmp_path):
    out = _run(script, "fsdp", "sgd", 1, tmp_path / "ckpt")

    # built on the meta device, then every shard filled with a plain same-seed build's values
    assert out["meta_after_init"] is True
    torch.manual_seed(0)
    plain = make_net()
    assert out["initial"] == _flat(plain)  # exactly, not approximately
    assert out["rng_after_setup"] == torch.rand(1).item()  # generator moved on as after a plain build

    # each rank holds about half of the parameters
    total = sum(p.numel() for p in plain.parameters())
    assert out["total_numel"] == total
    assert sum(out["local_numel"]) == total
    for numel, nbytes in zip(out["local_numel"], out["local_bytes"]):
        assert 0.45 * total <= numel <= 0.55 * total
        assert nbytes <= 0.55 * total * 4
    # the optimizer built from meta parameters now updates the shards, same hyper-parameters
    assert out["opt_points_at_model"] and out["opt_lr"] == 0.1

    # SGD steps, accumulation with no_backward_sync, global-norm clipping: as one process
    norms: dict[str, float] = {}
    model, _, norm = reference("sgd", norms=norms)
    assert_close(out["params"], _flat(model), 1e-5, "parameters")
    _assert_sharded_like(out["local_params"], model)
    assert out["norm"] == pytest.approx(norm, rel=1e-5)
    assert out["norm_inf"] == pytest.approx(norms["norm_inf"], rel=1e-5)  # norm_type=inf over both shards
    assert out["norm_1"] == pytest.approx(norms["norm_1"], rel=1e-5)
    assert norm > 0.05  # clipping really happened

    # a module that initialises in __init__ (no reset_parameters()) gets a plain build's values
    torch.manual_seed(5)
    assert out["bare"] == torch.randn(4).tolist()
    # one that reads its own random values while it is built is refused, with the ways out
    assert "cannot give this model the values a plain build gives it" in out["peek_error"]
    assert "sharded_init(empty=True)" in out["peek_error"]

    # join refuses a model that was not set up, naming the fix
    assert "lite.join takes the models returned by lite.setup" in out["join_error"]
    assert "`model = lite.setup(model)`" in out["join_error"]

    # sharded save -> train on -> load restores the outputs exactly
    with torch.no_grad():
        assert_close(out["probe_at_save"], model(probe()).flatten().tolist(), 1e-5, "outputs at the save")
    assert out["probe_after_step"] != out["probe_at_save"]
    assert out["probe_after_load"] == out["probe_at_save"]
    assert out["probe_after_step_again"] == out["probe_after_step"]
    assert out["step"] == 4 and out["rest"] == {}
    assert (tmp_path / "ckpt").is_dir()


@pytest.mark.timeout(120)
def test_adamw_trains_like_one_process_and_a_sharded_checkpoint_reloads_on_one_process(script, tmp_path):
    folder = tmp_path / "sharded"
    fsdp = _run(script, "fsdp", "adamw", 1, folder)
    model, _, norm = reference("adamw")
    assert_close(fsdp["params"], _flat(model), 1e-5, "parameters")
    _assert_sharded_like(fsdp["local_params"], model)
    assert fsdp["norm"] == pytest.approx(norm, rel=1e-5)
    # AdamW moments restored: the step after loading repeats the step after saving
    assert fsdp["probe_after_step_again"] == fsdp["probe_after_step"]

    # 2 ranks -> 1 process: the folder itself, and the file consolidated from it, load alike
    single = tmp_path / "single.pt"
    lite.consolidate_checkpoint(folder, single)
    for source in (folder, single):
        torch.manual_seed(123)
        model = make_net()
        opt = make_optimizer("adamw", model.parameters())
        state = {"model": model, "opt": opt, "step": 0}
        assert lite.load(source, state) == {}
        assert state["step"] == 4
        with torch.no_grad():
            assert model(probe()).flatten().tolist() == pytest.approx(fsdp["probe_at_save"], abs=1e-6)
        x, y = make_data()
        loss = torch.nn.functional.mse_loss(model(x[-8:]), y[-8:])
        loss.backward()
        opt.step()
        with torch.no_grad():
            assert model(probe()).flatten().tolist() == pytest.approx(fsdp["probe_after_step"], abs=1e-5)


@pytest.mark.timeout(100)
def test_full_state_dict_with_wrapping_policy_and_activation_checkpointing(script, tmp_path):
    # every Linear its own FSDP unit, activations recomputed, no resharding after forward
    out = _run(script, "fsdp_full_wrapped", "adamw", 1, tmp_path / "full.pt")
    torch.manual_seed(0)
    assert out["initial"] == _flat(make_net())  # nested units replay the same values
    reference_model, _, norm = reference("adamw")
    assert_close(out["params"], _flat(reference_model), 1e-5, "parameters")
    assert out["norm"] == pytest.approx(norm, rel=1e-5)

    assert out["probe_after_load"] == out["probe_at_save"]
    assert out["probe_after_step_again"] == out["probe_after_step"]
    # the full file is the ordinary single-file checkpoint: it loads on one process as is
    model = make_net()
    opt = make_optimizer("adamw", model.parameters())
    assert lite.load(tmp_path / "full.pt", {"model": model, "opt": opt}) == {"step": 4}
    with torch.no_grad():
        assert model(probe()).flatten().tolist() == pytest.approx(out["probe_at_save"], abs=1e-6)
    assert len(opt.state) == len(list(model.parameters()))
    x, y = make_data()
    torch.nn.functional.mse_loss(model(x[-8:]), y[-8:]).backward()
    opt.step()
    with torch.no_grad():
        assert model(probe()).flatten().tolist() == pytest.approx(out["probe_after_step"], abs=1e-5)


@pytest.mark.timeout(100)
def test_plain_build_and_bf16_mixed_computes_in_bf16_on_fp32_shards(script, tmp_path):
    # built without sharded_init: the plain model is sharded in setup, from rank 0's values
    out = _run(script, "fsdp", "sgd", 0, tmp_path / "ckpt", "bf16-mixed")
    torch.manual_seed(0)
    assert out["initial"] == _flat(make_net())
    assert out["param_dtype"] == "torch.float32"  # the sharded master copy stays fp32
    assert out["output_dtype"] == "torch.bfloat16"  # gathered and computed in bf16
    reference_model, _, _ = reference("sgd")
    diff = max_diff(out["params"], _flat(reference_model), "parameters")
    assert 0 < diff < 0.05, diff  # bf16 rounding, nothing more
    _assert_sharded_like(out["local_params"], reference_model, 0.05)


def test_bad_options_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"state_dict_type='local'.*'sharded', 'full'"):
        lite.FSDPStrategy(state_dict_type="local")
    with pytest.raises(TypeError, match=r"auto_wrap_policy=Linear is a single class.*\{Linear\}"):
        lite.FSDPStrategy(auto_wrap_policy=torch.nn.Linear)
    with pytest.raises(TypeError, match="auto_wrap_policy must hold torch.nn.Module subclasses"):
        lite.FSDPStrategy(auto_wrap_policy={int})
    with pytest.raises(TypeError, match="activation_checkpointing must be a non-empty set"):
        lite.FSDPStrategy(activation_checkpointing="Linear")
    with pytest.raises(TypeError, match="reshard_after_forward must be True or False"):
        lite.FSDPStrategy(reshard_after_forward="yes")
    with pytest.raises(ValueError, match="start_method='spawn'"):
        lite.FSDPStrategy(start_method="spawn")
    lite.FSDPStrategy(auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear))  # a callable is fine


def test_bad_combinations_are_refused_before_anything_starts():
    machine = lite.Machine(cpu_count=2, has_script=False)
    with pytest.raises(ValueError, match="cpu_offload=True.*accelerator='cpu'"):
        lite.resolve(
            strategy=lite.FSDPStrategy(cpu_offload=True), devices=2, accelerator="cpu", env={}, machine=machine
        )
    with pytest.raises(ValueError, match="precision='16-mixed'"):
        lite.FSDPStrategy().check("cuda", 2, "16-mixed")
    with pytest.raises(ValueError, match="process_group_backend='nccl' needs accelerator='cuda'"):
        lite.resolve(
            strategy=lite.FSDPStrategy(process_group_backend="nccl"),
            devices=2,
            accelerator="cpu",
            env={},
            machine=machine,
        )
    plan = lite.resolve(strategy="fsdp", devices=2, accelerator="cpu", env={}, machine=machine)
    assert isinstance(plan.strategy, lite.FSDPStrategy) and plan.world_size == 2


def _joined_reference() -> list[dict[str, object]]:
    """One process, plain torch: the script's two join blocks over the ranks' uneven rows.

    At step s the ranks that still have a batch contribute the gradient of their mean loss;
    the sum is divided by all 4 ranks (``divide_by_initial_world_size=True``, clipped by norm)
    or by the running ones (False); AdamW steps either way.
    """
    torch.manual_seed(JOIN_SEED)
    model = make_net()
    opt = make_optimizer("adamw", model.parameters())
    x, y = make_data()
    batches = [
        [join_rows(r)[b * JOIN_BATCH : (b + 1) * JOIN_BATCH] for b in range(n)] for r, n in enumerate(JOIN_BATCHES)
    ]
    blocks = []
    for divide in (True, False):
        losses, norms = [], []
        for step in range(max(JOIN_BATCHES)):
            running = [r for r in range(4) if step < JOIN_BATCHES[r]]
            per_rank = [torch.nn.functional.mse_loss(model(x[batches[r][step]]), y[batches[r][step]]) for r in running]
            losses.append(float(sum(per_rank).detach()) / len(running))
            (sum(per_rank) / (4 if divide else len(running))).backward()
            if divide:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), JOIN_CLIP)))
            opt.step()
            opt.zero_grad()
        blocks.append({"losses": losses, "norms": norms, "params": _flat(model)})
    return blocks


@pytest.mark.timeout(150)
def test_hsdp_two_replicas_of_two_shards_train_and_join_like_one_process(script, tmp_path):
    """FSDPStrategy(replicate_degree=2) on 4 ranks (tests/scripts/hsdp.py), against plain torch."""
    result = script("hsdp", timeout=140)
    assert result.returncode == 0, result.explain()
    out = result.json()
    ranks = out["per_rank"]
    assert len(ranks) == 4

    # a (replicate 2, shard 2) mesh: ranks 0-1 one replica, 2-3 the other; every rank its own data
    for r, mine in enumerate(ranks):
        assert mine["mesh"] == [["replicate", "shard"], [[0, 1], [2, 3]]]
        assert mine["placements"] == ["R", "S(0)"]
        assert mine["data_parallel"] == [r, 4]

    # sharded_init: the meta build filled with a plain build's values from rank 0's seed; each
    # rank holds half of every parameter (its replica's chunk r % 2), not a quarter
    torch.manual_seed(0)
    plain = make_net()
    assert all(mine["meta"] for mine in ranks)
    assert out["initial"] == _flat(plain)  # exactly
    after_build = torch.rand(1).item()
    torch.manual_seed(7)
    make_net()  # the others' own generators moved on as after their own plain build
    assert [mine["rng_after_setup"] for mine in ranks] == [after_build] + [torch.rand(1).item()] * 3
    _assert_sharded_like([mine["initial_local"] for mine in ranks], plain, 0.0, shards=2)

    # training: rows r::4 of each batch of 8, an accumulation window, clipping by norm
    norms: dict[str, float] = {}
    model, _, norm = reference("adamw", norms=norms)
    assert_close(out["trained"], _flat(model), 1e-6, "parameters")
    _assert_sharded_like([mine["trained_local"] for mine in ranks], model, 1e-6, shards=2)
    for mine in ranks:
        assert mine["norm"] == pytest.approx(norm, rel=1e-6)
        assert mine["norm_inf"] == pytest.approx(norms["norm_inf"], rel=1e-6)
        assert mine["norm_1"] == pytest.approx(norms["norm_1"], rel=1e-6)

    # each synchronised backward reduce-scatters within the replica and all-reduces across
    # replicas (plain FSDP: the reduce-scatter alone); inside lite.no_backward_sync (the 4th
    # backward) nothing is reduced. A synchronised lite.backward also all-reduces two integers
    # of ours, the digest of the optimizers' steps since the previous one (stepped.py)
    synced = {"c10d::_reduce_scatter_base_": 1, "c10d::allreduce_": 1 + 1}
    for mine in ranks:
        assert mine["backward_collectives"] == [synced, None, None, {}, synced]  # the 2nd and 3rd not counted

    # a forward on rank 0 alone, the others in lite.barrier(): refused at once, naming the fix
    alone = ranks[0]["alone"]
    assert "ran on rank(s) [0] only" in alone and "waits in a collective" in alone, alone
    assert "strategy='fsdp'" in alone and "lite.join(model)" in alone, alone

    # a plain torch run's state dicts loaded on every rank with load_state_dict: each rank took
    # its shard (AdamW's moments too), and the next step is plain torch's
    model_state, opt_state = plain_run_state()
    torch.manual_seed(11)
    resumed = make_net()
    ropt = make_optimizer("adamw", resumed.parameters())
    resumed.load_state_dict(model_state)
    ropt.load_state_dict(opt_state)
    assert out["plain_loaded"] == _flat(resumed)  # exactly
    x, y = make_data()
    step_after_plain_load(resumed, ropt, lambda s: (x[s], y[s]), lambda loss: loss.backward())
    assert_close(out["plain_loaded_step"], _flat(resumed), 1e-6, "the step after a plain load")

    # lite.join: ranks with 3, 1, 0 and 2 batches, every step as one process computes it
    expected = _joined_reference()
    for r, mine in enumerate(ranks):
        for block, want in zip(mine["join"], expected, strict=True):
            assert block["steps"] == sum(JOIN_BATCHES)
            assert_close(block["params"], want["params"], 1e-6, f"rank {r}'s joined parameters")
            for key in ("losses", "norms"):  # what this rank saw while it still had data
                if not JOIN_BATCHES[r] or not want[key]:
                    assert block[key] == [], (r, key)  # rank 2 has none; only the first block clips
                else:
                    assert_close(block[key], want[key][: JOIN_BATCHES[r]], 1e-5, f"rank {r}'s {key}")


def test_hsdp_replicate_degree_is_validated():
    machine = lite.Machine(cpu_count=4, has_script=False)
    for bad in (0, -2, 1.5, True, "2", None):
        with pytest.raises(ValueError, match=rf"FSDPStrategy\(replicate_degree={bad!r}\) is not valid.*'auto'"):
            lite.FSDPStrategy(replicate_degree=bad)
    with pytest.raises(ValueError, match=r"replicate_degree=3\) does not fit a run of 4 processes.*one of \[1, 2, 4\]"):
        lite.resolve(
            strategy=lite.FSDPStrategy(replicate_degree=3), devices=4, accelerator="cpu", env={}, machine=machine
        )
    plan = lite.resolve(
        strategy=lite.FSDPStrategy(replicate_degree=2), devices=4, accelerator="cpu", env={}, machine=machine
    )
    assert "replicate_degree=2" in plan.strategy.describe()
    assert hsdp_shape(2, 4, per_node=4) == (2, 2) and hsdp_shape(4, 4, per_node=4) == (4, 1)
    assert hsdp_shape("auto", 8, per_node=4) == (2, 4)  # one replica per node, sharded within it
    assert hsdp_shape("auto", 4, per_node=4) == (1, 4)  # one node: plain FSDP
    with pytest.raises(ValueError, match=r"replicate_degree='auto'.*6 processes.*nodes of 4"):
        hsdp_shape("auto", 6, per_node=4)


@pytest.mark.timeout(130)
def test_a_state_dict_saved_by_rank_zero_alone_is_refused_where_it_would_load_another_ranks_shard(script):
    """`if rank == 0: torch.save(model.state_dict(), path)`, then every rank loads the file:
    rank 1 refuses (before: rank 0's shard silently in rank 1's place, the parameters wrong on
    every rank), naming lite.save; rank 0 loads its own shard. One file per rank, each loading
    its own, gives back the trained parameters exactly."""
    result = script("shard_file", timeout=100)
    assert result.returncode == 0, result.explain()
    seen = result.json()
    assert seen[0]["errors"] == {"model": None, "optimizer": None}
    model_error, optimizer_error = seen[1]["errors"]["model"], seen[1]["errors"]["optimizer"]
    assert "the shard another rank held" in model_error, model_error
    assert "lite.save(path, {'model': model})" in model_error
    assert optimizer_error.startswith("optimizer.load_state_dict got 'exp_avg' of parameter 0 as the shard"), (
        optimizer_error
    )
    assert "lite.save(path, {'model': model, 'optimizer': optimizer})" in optimizer_error
    for out in seen:
        assert out["own_files"] == out["trained"]
        assert out["trained"] == seen[0]["trained"]
        assert out["own_moments"] == out["trained_moments"] == seen[0]["trained_moments"]
        assert any(v != 0.0 for m in out["trained_moments"] for v in m)  # a test that can fail
        assert not out["live_marked"]  # the optimizer's own tensors carry nothing of ours


@pytest.mark.timeout(130)
def test_lite_save_or_load_on_rank_zero_alone_is_refused_at_once(script):
    """`if run.is_global_zero: lite.save(path, state)` (and lite.load), the DDP habit: under
    fsdp every rank writes its part, so rank 0's first collective met rank 1's next forward
    and the run waited for the watchdog. Now rank 0 is refused at once, before any
    collective, naming the fix; it catches it and the ranks stay in step (training equals
    plain torch's), and a save and load on every rank round-trip."""
    result = script("save_on_some_ranks", "fsdp", timeout=100)
    assert result.returncode == 0, result.explain()
    check_save_on_some_ranks(result.json())


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_a_backward_skipped_on_one_rank_is_refused_at_its_next_forward(script, strategy):
    """Rank 1 skips the backward of a step (`if not torch.isfinite(loss): continue`): its next
    forward would gather while rank 0's backward reduces, and the run hung until the
    collective timeout. Now that forward is refused at once, naming rank 0's backward and the
    fix, and the run ends. Two forwards per backward on every rank, and evaluations on every
    rank, are not refused and train as plain torch. The same under model_parallel."""
    result = script("skip_on_gathering", strategy, timeout=100)
    check_skip_on_gathering(result)


@pytest.mark.timeout(130)
@pytest.mark.parametrize(
    ("strategy", "asymmetry"),
    [("fsdp", "scheduler"), ("fsdp", "step"), ("fsdp", "clip"), ("model_parallel", "scheduler")],
)
def test_a_scheduler_or_step_on_one_rank_is_refused_at_the_next_backward(script, strategy, asymmetry):
    """As under ddp (test_ddp.py): `if rank == 0: scheduler.step()`, one more
    `optimizer.step()` on rank 1, or `lite.clip_gradients(clip_val=...)` on rank 0 alone (a
    clamp of each rank's shard: no collective), had each rank step its shard with its own rate
    (or once more, or clamped) and the model was no longer one model, without a word. lite.backward now posts the digest
    of the steps since the previous backward in one all-reduce and reads it after: the backward
    after the first differing step raises on every rank, naming what its optimizer did; the
    next collective pairs. The correct part before it (a dropped model rank 1 still holds, a
    join block over uneven batches) equals plain torch. model_parallel: FSDP2 over its
    data-parallel dimension."""
    result = script("scheduler_on_some_ranks", strategy, asymmetry, timeout=100)
    assert result.returncode == 0, result.explain()
    check_scheduler_on_some_ranks(result.json(), asymmetry)
