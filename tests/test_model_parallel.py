"""2D parallelism (tensor parallel x FSDP2, the user's plan) on 4 real gloo ranks.

One script run (``tests/scripts/model_parallel.py``) covers every multi-process check: a
data_parallel=2 x tensor_parallel=2 run with the plan of docs/strategies.md (training,
evaluation, checkpoints, ``lite.join`` over uneven data-parallel shards), then a second launch
block on another mesh shape (1 x 2) that loads its checkpoints. This process replays
the same recipe with plain torch on one process, over the same two shards, and compares.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import pytest
import torch

import scopedlite as lite
from scopedlite._strategies.abilities import SupportsJoin, SupportsNoBackwardSync
from scopedlite._strategies.model_parallel.strategy import mesh_shape
from scopedlite._strategies.registry import names_supporting

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from _common import assert_close, max_diff
from _model_parallel_common import (
    BATCH,
    CLIP_NORM,
    JOIN_CLIP,
    JOIN_EMPTY_SHARES,
    JOIN_SEED,
    JOIN_SHARES,
    N_EVAL,
    N_JOIN_EVAL,
    N_TRAIN,
    data,
    eval_data,
    join_eval_data,
    make_net,
    probe,
    train,
)


def _flat(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _last_global_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    _, x, y = (t[N_TRAIN - 2 * BATCH :] for t in data())
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _reference() -> tuple[torch.nn.Module, list[int], dict[str, float], float]:
    """One process: each step's batch is both replicas' batches together (replica d reads rows
    d, d + 2, ... in batches of BATCH), so the mean loss is the mean of the two replicas'."""
    torch.manual_seed(0)
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    index, x, y = data()
    shares = [list(range(N_TRAIN))[d::2] for d in range(2)]
    steps = []
    for b in range(len(shares[0]) // BATCH):
        rows = [r for share in shares for r in share[b * BATCH : (b + 1) * BATCH]]
        steps.append((index[rows], x[rows], y[rows]))

    def clip(max_norm=None, clip_val=None, norm_type=2.0):
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_val)
            return None
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)

    rows, norms = train(model, opt, steps, lambda loss: loss.backward(), lambda _: contextlib.nullcontext(), clip)
    _, ex, ey = eval_data()
    with torch.no_grad():
        eval_mean = float(((model(ex) - ey) ** 2).sum() / N_EVAL)
    return model, rows, {k: float(v) for k, v in norms.items()}, eval_mean


def _joined_reference(divisors: tuple[str, str] = ("initial", "running")) -> dict[str, object]:
    """One process, plain torch: the three join blocks of the script over the same shards.

    At step s the replicas that still have a batch contribute the gradient of their mean
    loss; the sum is divided by both replicas (``divide_by_initial_world_size=True``) or by
    the running ones (False). The first block clips by norm, all step AdamW. The third is one
    step on replica 0's two accumulated batches (replica 1 has none), divided by 2.
    """
    torch.manual_seed(JOIN_SEED)
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, x, y = data()
    batches = [[share[b * BATCH : (b + 1) * BATCH] for b in range(len(share) // BATCH)] for share in JOIN_SHARES]
    blocks = []
    for divisor in divisors:
        losses, norms = [], []
        for step in range(max(map(len, batches))):
            running = [d for d in range(2) if step < len(batches[d])]
            per_replica = [
                torch.nn.functional.mse_loss(model(x[batches[d][step]]), y[batches[d][step]]) for d in running
            ]
            losses.append(float(sum(per_replica).detach()) / len(running))
            (sum(per_replica) / (2 if divisor == "initial" else len(running))).backward()
            if len(blocks) == 0:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), JOIN_CLIP)))
            opt.step()
            opt.zero_grad()
        blocks.append({"losses": losses, "norms": norms, "params": _flat(model)})
    # a replica with no data: one step on replica 0's two accumulated batches, divided by 2
    share = JOIN_EMPTY_SHARES[0]
    for b in range(len(share) // BATCH):
        rows = share[b * BATCH : (b + 1) * BATCH]
        (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / 2).backward()
    opt.step()
    opt.zero_grad()
    blocks.append({"params": _flat(model)})
    _, ex, ey = join_eval_data()
    with torch.no_grad():
        eval_mean = float(((model(ex) - ey) ** 2).sum() / N_JOIN_EVAL)
    return {"blocks": blocks, "eval_mean": eval_mean}


@pytest.mark.timeout(150)
def _single_checkpoint(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A checkpoint of strategy single (one process, no launch), after one AdamW step."""
    torch.manual_seed(42)
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _last_global_step(model, opt)
    lite.save(path, {"model": model, "opt": opt, "step": 3})
    return model, opt


def test_two_dimensional_run_trains_evaluates_and_checkpoints_like_one_process(script, tmp_path):
    single, single_opt = _single_checkpoint(tmp_path / "single.ckpt")
    result = script("model_parallel", tmp_path, timeout=140)
    assert result.returncode == 0, result.explain()
    out = result.json()
    ranks = out["per_rank"]
    assert len(ranks) == 4 and out["ranks"] == 2  # all_gather: one row per replica

    # the mesh built at launch; rank r is replica r // 2
    for r, mine in enumerate(ranks):
        assert mine["mesh"] == [["data_parallel", "tensor_parallel"], [2, 2]]
        assert mine["data_parallel"] == [r // 2, 2]
        assert mine["replica_ranks"] == [2 * (r // 2), 2 * (r // 2) + 1]

    # sharded_init: built on the meta device, every slice filled with a plain build's values
    torch.manual_seed(0)
    plain = make_net()
    assert all(mine["meta"] for mine in ranks)
    assert out["initial"] == _flat(plain)  # exactly
    assert ranks[0]["rng_after_setup"] == torch.rand(1).item()  # the generator moved on as after a plain build
    # the plan as written: tensor-parallel layers on the 2D mesh, the LayerNorm on data parallel only
    assert ranks[0]["placements"]["2.weight"] == ["S(0)", "S(1)"]
    assert ranks[0]["placements"]["0.weight"][1] == "S(0)"
    assert ranks[0]["placements"]["3.weight"] == ["S(0)"]
    total = sum(p.numel() for p in plain.parameters())
    assert all(mine["local_numel"] <= 0.27 * total for mine in ranks)  # about a quarter each
    assert all(mine["opt_on_model"] for mine in ranks)
    # the set-up model is the user's: their attributes and methods, plain state_dict keys
    for mine in ranks:
        assert mine["answers"] == ["mine", 32, 4, "LayerNorm"]
        assert mine["state_keys"] == list(plain.state_dict())
    # lite.no_backward_sync skips FSDP's gradient reduction (step 2), and only there
    for mine in ranks:
        assert mine["scatters"][2] == 0 and min(mine["scatters"][:2] + mine["scatters"][3:]) > 0, mine["scatters"]

    # the loader shards over data parallel only: a replica's two ranks read the same rows
    for key, n in (("train_rows", N_TRAIN), ("eval_rows", N_EVAL)):
        assert ranks[0][key] == ranks[1][key] and ranks[2][key] == ranks[3][key]
        assert sorted(ranks[0][key] + ranks[2][key]) == list(range(n))  # every sample once

    # training (plain steps, clipping by value, accumulation with no_backward_sync, clipping
    # by norm) and no_grad evaluation match the one-process reference over the same two shards
    model, rows, norms, eval_mean = _reference()
    assert sorted(rows) == list(range(N_TRAIN))
    assert_close(out["trained"], _flat(model), 1e-5, "trained parameters")
    for mine in ranks:
        assert mine["norms"]["2"] == pytest.approx(norms["2"], rel=1e-5)
        assert mine["norms"]["inf"] == pytest.approx(norms["inf"], rel=1e-5)
    assert norms["2"] > CLIP_NORM  # clipping by norm really happened
    assert out["eval_mean"] == pytest.approx(eval_mean, rel=1e-5)
    # the collectives count each replica once, as ddp counts each rank (not each process:
    # 2 * N_EVAL), and refuse a replica whose ranks disagree, on every rank
    for mine in ranks:
        assert mine["eval_count"] == N_EVAL
        assert sorted(mine["eval_gathered"]) == list(range(N_EVAL))
        assert mine["replica_mean"] == 0.5 and mine["replica_gather"] == [0, 1]
        assert "ranks 0 and 1 of replica 0 passed different values" in mine["replica_error"], mine["replica_error"]
        assert "rank 1: [1.0, 1.0] (float32[2])" in mine["replica_error"]

    # checkpoint round trips on the same mesh are exact: values, outputs, the next step (AdamW
    # state); also for the folder saved with blocking=False just before that step was taken
    for kind in ("sharded", "full.pt", "background"):
        for mine in ranks:
            assert mine[f"{kind}_exact"] and mine[f"{kind}_next_step_exact"] and mine[f"{kind}_step"] == 4
    assert out["after_step"] != out["at_save"]

    # ... and onto another mesh shape (1 x 2 on 2 processes): the same values, the same
    # outputs and next step (up to the order of the sums), the rest of the loader's pass
    taken = ranks[0]["taken_rows"] + ranks[2]["taken_rows"]
    assert ranks[1]["taken_rows"] == ranks[0]["taken_rows"] and len(set(taken)) == 2 * BATCH
    for mine in out["other_mesh"]:
        assert mine["mesh"] == [1, 2] and mine["data_parallel"] == [0, 1]
        for kind in ("sharded", "full.pt"):
            assert mine[f"{kind}_params"] == out["at_save"]
            assert mine[f"{kind}_step"] == 4
            assert mine[f"{kind}_outputs"] == pytest.approx(out["outputs_at_save"], abs=1e-6)
            assert_close(mine[f"{kind}_after_step"], out["after_step"], 1e-6, f"{kind}: the next step on another mesh")
            assert sorted(mine[f"{kind}_rest_of_pass"] + taken) == list(range(N_TRAIN))

    # ... and both ways with fsdp: the folder loads into FSDP's shards on 2 ranks, and FSDP's
    # own folder, saved after one more step there, loads on the 1 x 2 mesh
    for moved in out["fsdp"]:
        assert moved["params"] == out["at_save"] and moved["step"] == 4
        assert_close(moved["after_step"], out["after_step"], 1e-6, "the next step under fsdp")
    for mine in out["other_mesh"]:
        assert mine["from_fsdp"]["params"] == out["fsdp"][0]["after_step"] and mine["from_fsdp"]["step"] == 5

    # a checkpoint of strategy single resumed on the 2 x 2 mesh: its values, step and
    # AdamW state (the next step equals one process's)
    expected = [p.detach().flatten().tolist() for p in single.parameters()]
    _last_global_step(single, single_opt)
    for mine in ranks:
        assert mine["from_single"]["params"] == expected and mine["from_single"]["step"] == 3
        assert_close(mine["from_single"]["after_step"], _flat(single), 1e-6, "the step after a single checkpoint")
        # the same file through torch.load and torch's own load_state_dict (a DDP script's resume)
        assert mine["plain_loads"]["params"] == expected
        assert_close(mine["plain_loads"]["after_step"], _flat(single), 1e-6, "the step after a plain load")

    # ... and in one process, without processes: the full file as it is, the folder consolidated,
    # and the folder as it is
    single = tmp_path / "consolidated.pt"
    lite.consolidate_checkpoint(tmp_path / "sharded", single)
    for path in (tmp_path / "full.pt", single, tmp_path / "sharded"):
        torch.manual_seed(5)
        model = make_net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "opt": opt, "step": 0}
        lite.load(path, state)
        assert _flat(model) == out["at_save"] and state["step"] == 4
        with torch.no_grad():
            assert model(probe()).flatten().tolist() == pytest.approx(out["outputs_at_save"], abs=1e-6)
        _last_global_step(model, opt)
        assert_close(_flat(model), out["after_step"], 1e-6, f"{path.name}: the next step in one process")

    # lite.join over uneven data-parallel shards (5 and 3 batches): every rank ends with the
    # parameters of one process that trains on the same two shards, under both divisors;
    # the lite collective in the loop covers the running replicas, the one after it all
    reference = _joined_reference()
    for r, mine in enumerate(ranks):
        steps = len(JOIN_SHARES[r // 2]) // BATCH  # replica 0: 5 steps, replica 1: 3 (it leaves early)
        for block, expected, divide in zip(mine["join"][:2], reference["blocks"][:2], (True, False), strict=True):
            where = f"rank {r}, divide_by_initial_world_size={divide}"
            assert block["rows"] == JOIN_SHARES[r // 2], where  # 20 or 12 rows, each once
            assert block["seen"] == N_TRAIN  # each replica counted its rows once
            # a rank logs the losses of its own steps: the reference's first `steps`
            assert_close(block["losses"], expected["losses"][:steps], 1e-5, f"{where}: losses", relative=True)
            if divide:  # clipped by norm
                assert_close(block["norms"], expected["norms"][:steps], 1e-5, f"{where}: norms", relative=True)
            else:
                assert block["norms"] == [] and expected["norms"] == [], where
            assert_close(block["params"], expected["params"], 1e-5, f"{where}: parameters")
    for block in reference["blocks"][:2]:
        assert len(block["losses"]) == 5  # the reference runs every step of the longer replica
    for r, mine in enumerate(ranks):  # a replica with no data, replica 0 in an accumulation window
        block, expected = mine["join"][2], reference["blocks"][2]
        assert block["rows"] == JOIN_EMPTY_SHARES[r // 2] and block["seen"] == len(JOIN_EMPTY_SHARES[0])
        assert_close(block["params"], expected["params"], 1e-5, f"rank {r}: the block with an empty replica")
        assert max_diff(block["params"], mine["join"][1]["params"]) > 1e-3  # it did train
    assert min(reference["blocks"][0]["norms"]) > JOIN_CLIP  # clipping by norm really happened
    # ... and the test can fail: the other divisor in the second block is far off
    wrong = _joined_reference(("initial", "initial"))
    assert max_diff(ranks[0]["join"][1]["params"], wrong["blocks"][1]["params"]) > 1e-3

    # no_grad evaluation inside join sees every sample once (5 rows and 4 rows: 2 and 1 batches)
    for r, mine in enumerate(ranks):
        assert mine["join_eval"]["rows"] == list(range(N_JOIN_EVAL))[r // 2 :: 2]
        sse, count = mine["join_eval"]["totals"]  # each replica once
        assert count == N_JOIN_EVAL
        assert sse / count == pytest.approx(reference["eval_mean"], rel=1e-5)
    # gathered per batch: each sample once on replica 0, which ran the last batch alone
    # (replica 1 had left by then: it has the first batch's gather only)
    assert sorted(ranks[0]["join_eval"]["gathered"]) == list(range(N_JOIN_EVAL))
    assert ranks[0]["join_eval"]["gathered"] == ranks[1]["join_eval"]["gathered"]
    first_batches = list(range(0, 2 * BATCH, 2)) + list(range(1, 2 * BATCH, 2))
    assert ranks[2]["join_eval"]["gathered"] == ranks[3]["join_eval"]["gathered"] == first_batches

    # torch.compile(model) before setup: compiled, plain keys, two steps as one process takes them
    torch.manual_seed(0)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _, x, y = data()
    for step in range(2):
        rows = slice(step * 2 * BATCH, (step + 1) * 2 * BATCH)
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    for mine in ranks:
        assert mine["compiled"]["graphs"] >= 1 and mine["compiled"]["keys"] == list(net.state_dict())
        assert_close(mine["compiled"]["params"], _flat(net), 1e-6, "the compiled model's parameters")

    # refusals: a replica whose ranks are not in step (on every rank, at once: nobody hangs),
    # a plan that leaves the replicas apart
    for mine in ranks:
        assert "data-parallel replica 1 (ranks 2, 3) are not in step" in mine["split_error"], mine["split_error"]
        assert re.search(r"rank 2: left the block; rank 3: forward #\d+ of model 0", mine["split_error"])
    assert "fully_shard(model, mesh=mesh['data_parallel'])" in ranks[0]["unsynced_error"]
    assert "'0.weight'" in ranks[0]["unsynced_error"]


@pytest.mark.parametrize(
    ("sizes", "world", "per_node", "shape"),
    [
        (("auto", "auto"), 4, 4, (1, 4)),  # as Fabric: tensor parallel within a node
        (("auto", "auto"), 8, 4, (2, 4)),  # ... data parallel across nodes
        ((2, "auto"), 4, 4, (2, 2)),  # one given: the other is the rest of the world
        (("auto", 2), 8, 8, (4, 2)),
        ((2, 2), 4, 4, (2, 2)),
    ],
)
def test_mesh_sizes(sizes, world, per_node, shape):
    assert mesh_shape(*sizes, world, per_node) == shape


@pytest.mark.parametrize(
    ("sizes", "world", "words"),
    [
        ((3, 2), 4, ["data_parallel=3, tensor_parallel=2", "4 processes", "multiply to 4"]),
        ((3, "auto"), 4, ["data_parallel=3, tensor_parallel='auto'", "multiply to 4", "data_parallel=2"]),
        (("auto", 3), 8, ["data_parallel='auto', tensor_parallel=3", "multiply to 8"]),
    ],
)
def test_sizes_that_do_not_fit_the_world_are_refused_before_anything_starts(sizes, world, words):
    machine = lite.Machine(cpu_count=2, has_script=True)
    strategy = lite.ModelParallelStrategy(lambda model, mesh: model, *sizes)
    with pytest.raises(ValueError) as info:
        lite.resolve(strategy=strategy, devices=world, accelerator="cpu", env={}, machine=machine)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_bad_options_and_the_name_without_a_plan():
    for bad in (0, -1, True, "two", 1.5):
        with pytest.raises(ValueError, match="pass a positive number of processes or 'auto'"):
            lite.ModelParallelStrategy(lambda model, mesh: model, data_parallel=bad)
    with pytest.raises(TypeError, match=r"parallelize\(model, mesh\) -> model"):
        lite.ModelParallelStrategy("colwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="state_dict_type='local'"):
        lite.ModelParallelStrategy(state_dict_type="local")

    machine = lite.Machine(cpu_count=2, has_script=True)
    plan = lite.resolve(strategy="model_parallel", devices=4, accelerator="cpu", env={}, machine=machine)
    assert isinstance(plan.strategy, lite.ModelParallelStrategy) and plan.strategy.parallelize is None
    with pytest.raises(RuntimeError, match=r"lite\.ModelParallelStrategy\(parallelize\)"):
        plan.strategy.setup_module(torch.nn.Linear(2, 2))
    assert "model_parallel" in names_supporting(SupportsJoin)
    assert "model_parallel" in names_supporting(SupportsNoBackwardSync)


def test_the_command_line_name_agrees_with_an_instance_of_its_own_kind_only():
    machine = lite.Machine(cpu_count=2, has_script=True)
    env = {"SCOPEDLITE_CLI_STRATEGY": "model_parallel", "SCOPEDLITE_CLI_DEVICES": "4"}
    instance = lite.ModelParallelStrategy(lambda model, mesh: model, data_parallel=2)
    plan = lite.resolve(strategy=instance, accelerator="cpu", env=env, machine=machine)
    assert plan.strategy.data_parallel == 2 and plan.world_size == 4  # the script's instance, with its plan
    with pytest.raises(ValueError, match="--strategy fsdp"):  # an FSDPStrategy subclass, yet not fsdp
        lite.resolve(
            strategy=instance, accelerator="cpu", env={**env, "SCOPEDLITE_CLI_STRATEGY": "fsdp"}, machine=machine
        )
    plan = lite.resolve(
        strategy=lite.FSDPStrategy(), accelerator="cpu", env={**env, "SCOPEDLITE_CLI_STRATEGY": "fsdp"}, machine=machine
    )
    assert plan.strategy.name == "fsdp"


def test_one_process_is_its_own_single_share():
    run = lite.current()
    assert (run.data_parallel_rank, run.data_parallel_size) == (0, 1)


def test_a_replica_runs_waits_and_leaves_as_one():
    """lite.join's verdict on a round: the ranks of one data-parallel replica (here ranks 0-1
    and 2-3) must be in the same state, announcing the same step, or every rank refuses."""
    from scopedlite._strategies.join.message import Kind, Round, Step

    replicas = (0, 0, 1, 1)
    forward, left = Step(Kind.FORWARD, grad=True, sync=True, seq=3).encode(), Step(Kind.LEFT).encode()
    assert Round([forward, forward, left, left]).replica_problem(replicas) is None  # replica 1 serves
    assert Round([forward] * 4).replica_problem(replicas) is None
    assert Round([left, forward, left, left]).replica_problem((0, 1, 2, 3)) is None  # one rank, one replica
    split = Round([forward, forward, left, forward]).replica_problem(replicas)
    assert "replica 1 (ranks 2, 3) are not in step (rank 2: left the block; rank 3: forward #3 of model 0)" in split
    passes = [Step(Kind.PASS, length=n).encode() for n in (5, 5, 3, 2)]  # the lengths agreed at a pass
    assert "rank 2: a new pass over a loader at site #0 of 3 batches; rank 3: a new pass" in Round(
        passes
    ).replica_problem(replicas)
    waiting = [forward, forward, Step(Kind.COLLECTIVE, ended=1).encode(), forward]  # rank 2 ahead of rank 3
    assert "rank 2: waits at a lite collective" in Round(waiting).replica_problem(replicas)
