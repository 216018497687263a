"""A checkpoint from any strategy and world size resumes under any other (issue 23).

Each saving strategy (single on 1 process; ddp, fsdp, deepspeed_stage_3 on 2 real gloo ranks)
trains epoch 0 and saves model, AdamW (two param groups), loader, step and a note; every
loading strategy, and fsdp on 1 and 3 ranks and deepspeed on 1, builds a model with other
values, loads each checkpoint and trains epoch 1. Every loss of every continued run must be
that of an uninterrupted run computed here, in one process, with plain torch (the saving
world size for epoch 0, the loading one for epoch 1: a step's gradient is the mean of the
ranks' mean losses, each rank reading what torch's ``DistributedSampler`` gives it).

Few launches serve the matrix: one per saving strategy (it also loads what exists by then),
one more for ddp and fsdp to load what was saved after them, one process running single,
deepspeed_stage_2 (which saves a ZeRO-2 checkpoint too), fsdp and deepspeed_stage_3 on one
device one after another, and fsdp on 3 ranks. HSDP (``FSDPStrategy(replicate_degree=2)`` on
4 ranks, issue 38) saves after deepspeed_stage_3 and loads all four, and the later launches
load its folder. A model of eight 4 MB parameters checks that loading a sharded checkpoint
never needs the whole model.

A checkpoint saved in the middle of epoch 0 (after its first step, by ddp and by ZeRO-3)
continues under other strategies on 2 ranks with the batch after the saved one. A launch of
deepspeed_stage_1 on 2 ranks saves a ZeRO-1 folder that ddp, single and fsdp continue.

The same launches load files plain torch wrote
(issue 36): a bare ``model.state_dict()``, one with DDP's ``module.`` prefix, and a dict of
a model's and an AdamW's state dicts and an epoch, each compared with the plain-torch model;
and every 2-rank launch tries ``lite.save`` / ``lite.load`` with a path that differs by rank.

The ddp, fsdp and deepspeed_stage_3 launches also save with ``blocking=False`` (issue 39): the
checkpoint holds the state at the call though training went on, failed background writes raise
on every rank and keep the previous checkpoint, the end of the block waits for a save left in
flight, and deepspeed refuses.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

import scopedlite as lite
from conftest import SCRIPTS, run_warm

sys.path.insert(0, str(SCRIPTS))
from _common import max_diff
from _moves_common import BATCH, make_data, make_net, make_optimizer, sampler

# Without DeepSpeed the moves between single, ddp and fsdp still run: the launches and jobs
# that need it are left out (_runnable) and the checks on them skip, saying why.
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install scopedlite[deepspeed])"
)
DEEPSPEED_CHECKPOINTS = {"Z", "Z2", "ZB", "Z1", "ZM"}  # written by DeepSpeed

pytestmark = [pytest.mark.timeout(400), pytest.mark.deepspeed_op]

# checkpoint name: the strategy and world size that saved it
SAVED = {
    "S": ("single", 1),
    "D": ("ddp", 2),
    "F": ("fsdp", 2),
    "Z": ("deepspeed_stage_3", 2),
    "Z2": ("deepspeed_stage_2", 1),
    "Z1": ("deepspeed_stage_1", 2),
    "H": ("hsdp", 4),  # HSDP: FSDPStrategy(replicate_degree=2), 2 replicas of 2 shards
}
# saved with lite.save(..., blocking=False), then trained on before anything waited (issue 39)
SAVED_IN_BACKGROUND = {"DA": ("ddp", 2), "FA": ("fsdp", 2)}
# saved after the first step of epoch 0 (the loader in the middle of its pass): by whom, loaded by whom
MID_EPOCH = {
    "DM": ("ddp", ["fsdp", "deepspeed_stage_3", "deepspeed_stage_1"]),
    "ZM": ("deepspeed_stage_3", ["ddp", "fsdp"]),
}
MATRIX = {"single": 1, "ddp": 2, "fsdp": 2, "deepspeed_stage_3": 2}
ALL = ["load:S", "load:D", "load:F", "load:Z", "load:Z2", "load:H"]
# files plain torch wrote (the fixture writes them): a bare state dict, the same from a
# DataParallel / DDP model (every key "module."-prefixed), and a dict of such a model's and
# an AdamW's state dicts and an epoch
PLAIN = ["plain:P", "plain:PD", "plain:PN"]
LAUNCHES = [  # in order: each loads what the launches before it saved
    [["single", 1, ["save:S", "load:S", *PLAIN]]],
    [
        [
            "ddp",
            2,
            ["save:D", "load:S", "load:D", "midsave:DM", *PLAIN, "paths:ddp", "async:DA", "load:DA", "inflight:DI"],
        ]
    ],
    [
        [
            "fsdp",
            2,
            [
                "save:F",
                "load:S",
                "load:D",
                "load:F",
                "midload:DM",
                "bigsave:FB",
                *PLAIN,
                "paths:fsdp",
                "async:FA",
                "load:FA",
                "inflight:FI",
            ],
        ]
    ],
    [
        [
            "deepspeed_stage_3",
            2,
            [
                "save:Z",
                "load:S",
                "load:D",
                "load:F",
                "load:Z",
                "midsave:ZM",
                "midload:DM",
                "bigload:FB",
                "bigsave:ZB",
                *PLAIN,
                "paths:ds3",
                "async:ZA",
            ],
        ]
    ],
    [["hsdp", 4, ["save:H", *ALL[:4], "load:H"]]],
    [["deepspeed_stage_1", 2, ["save:Z1", "midload:DM", "load:H", *PLAIN, "paths:ds1"]]],
    [["ddp", 2, ["load:F", "load:Z", "load:Z1", "load:H", "midload:ZM"]]],
    [["fsdp", 2, ["load:Z", "load:H", "midload:ZM", "bigload:ZB", "bigload:FB"]]],
    [  # one process, four launches one after another
        ["single", 1, ["load:D", "load:F", "load:Z", "load:Z1", "load:H"]],  # first: DeepSpeed not imported yet
        ["deepspeed_stage_2", 1, ["save:Z2", *ALL[:4], "load:Z2", "load:H", *PLAIN]],
        ["fsdp", 1, [*ALL, "load:Z1"]],
        ["deepspeed_stage_3", 1, ALL],
    ],
    [["fsdp", 3, [*ALL[:4], "load:H"]]],
]
PATHS = {"ddp": "ddp", "fsdp": "fsdp", "deepspeed_stage_3": "ds3", "deepspeed_stage_1": "ds1"}


def _runnable(launch: list) -> list:
    """``launch`` without its DeepSpeed blocks and its jobs on DeepSpeed's checkpoints, where
    DeepSpeed is not installed."""
    if HAS_DEEPSPEED:
        return launch
    return [
        [strategy, world_size, [job for job in jobs if job.split(":")[1] not in DEEPSPEED_CHECKPOINTS]]
        for strategy, world_size, jobs in launch
        if not strategy.startswith("deepspeed")
    ]


def _checkpoints(names: list[str]) -> list[str]:
    """The checkpoints (or ``load:`` jobs) of ``names`` that this environment can write."""
    return [n for n in names if HAS_DEEPSPEED or n.split(":")[-1] not in DEEPSPEED_CHECKPOINTS]


def _strategies(names: list) -> list:
    """Test parameters, those under DeepSpeed skipped without it."""
    return [
        pytest.param(*n, marks=needs_deepspeed) if str(n[0]).startswith("deepspeed") else pytest.param(*n)
        for n in names
    ]


@pytest.fixture(scope="module")
def moves(tmp_path_factory):
    """Every launch's results: {(strategy, world size): {job: result}}, and the folder."""
    folder = tmp_path_factory.mktemp("moves")
    _write_plain_files(folder)
    results: dict[tuple[str, int], dict[str, dict]] = {}
    for launch in filter(None, map(_runnable, LAUNCHES)):
        # DeepSpeed's launches from the zygote that imported it, but the one whose single block
        # must load ZeRO checkpoints without importing DeepSpeed
        deepspeed = any(s.startswith("deepspeed") for s, _, _ in launch) and all(s != "single" for s, _, _ in launch)
        result = run_warm(
            SCRIPTS / "checkpoint_moves.py",
            folder,
            json.dumps(launch),
            tmp_path=folder,
            timeout=240,
            cwd=folder,
            deepspeed=deepspeed,
        )
        assert result.returncode == 0, (
            f"launch {launch}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
        for block in result.json():
            results.setdefault((block["strategy"], block["world_size"]), {}).update(block["jobs"])
    return results, folder


def reference(
    phases: list[tuple[int, int]], fresh_optimizer: bool = False
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Plain torch, one process: for each ``(world_size, epoch)`` one epoch of steps whose
    gradient is that of the mean over ranks of each rank's mean loss. Returns each phase's
    losses and the final state dict. ``fresh_optimizer``: each phase with a new AdamW."""
    model = make_net(0)
    opt = make_optimizer(model)
    out = []
    for world_size, epoch in phases:
        opt = make_optimizer(model) if fresh_optimizer else opt
        out.append(_epoch(model, opt, world_size, epoch))
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, world_size: int, epoch: int) -> list[float]:
    data = make_data()
    x, y = data.tensors
    batches = []
    for rank in range(world_size):
        s = sampler(data, world_size, rank)
        s.set_epoch(epoch)
        order = list(s)
        batches.append([order[i : i + BATCH] for i in range(0, len(order), BATCH)])
    losses = []
    for step in range(len(batches[0])):
        loss = sum(torch.nn.functional.mse_loss(model(x[b[step]]), y[b[step]]) for b in batches) / world_size
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _write_plain_files(folder) -> None:
    """What plain torch scripts save after epoch 0 on one process (see PLAIN)."""
    model = make_net(0)
    opt = make_optimizer(model)
    _epoch(model, opt, 1, 0)
    torch.save(model.state_dict(), folder / "P")
    wrapped = torch.nn.DataParallel(model)  # on CPU a pass-through; its keys are DDP's: "module.a.weight"
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    torch.save(wrapped.state_dict(), folder / "PD")
    torch.save({"model": wrapped.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, folder / "PN")


def _close(got: list[float], expected: list[float]) -> float:
    """The largest relative difference (after checking the lengths agree, no NaN)."""
    return max_diff(got, expected, "losses", relative=True)


def _check_continued(result: dict, name: str, world_size: int) -> None:
    saver, saved_on = {**SAVED, **SAVED_IN_BACKGROUND}[name]
    (first, second), params = reference([(saved_on, 0), (world_size, 1)])
    assert result["step"] == len(first)  # the other entries came back
    assert result["note"] == {"from": saver, "tensor": [0.0, 1.0, 2.0]}
    assert _close(result["losses"], second) < 1e-6, (name, result["losses"], second)
    assert sorted(result["params"]) == sorted(params)  # the buffer came back too
    for key, value in params.items():
        assert torch.allclose(torch.tensor(result["params"][key]), value.flatten(), rtol=1e-5, atol=1e-6), key


def test_each_saving_run_follows_the_plain_torch_trajectory(moves):
    results, _ = moves
    for name, (strategy, world_size) in SAVED.items():
        if name not in _checkpoints([name]):
            continue
        (first,), _ = reference([(world_size, 0)])
        assert _close(results[(strategy, world_size)][f"save:{name}"]["losses"], first) < 1e-6, strategy


@pytest.mark.parametrize("loader", _strategies([(s,) for s in MATRIX]))
def test_every_checkpoint_continues_as_plain_torch_under_every_strategy(moves, loader):
    """The 4 x 4 matrix: single on 1 process, the others on 2 ranks. Each loss as plain
    torch's to 1e-6 (relative): the strategies sum gradients in other orders."""
    results, _ = moves
    for name in _checkpoints(["S", "D", "F", "Z"]):
        _check_continued(results[(loader, MATRIX[loader])][f"load:{name}"], name, MATRIX[loader])


@pytest.mark.parametrize("loader,world_size", _strategies([("fsdp", 1), ("fsdp", 3), ("deepspeed_stage_3", 1)]))
def test_checkpoints_continue_as_plain_torch_at_another_world_size(moves, loader, world_size):
    """fsdp 2 -> 1 and 2 -> 3, deepspeed 2 -> 1 (and every other checkpoint into them), as
    plain torch to 1e-6 (relative)."""
    results, _ = moves
    for job in _checkpoints(ALL if world_size == 1 else ALL[:4]):
        _check_continued(results[(loader, world_size)][job], job.split(":")[1], world_size)


@needs_deepspeed
def test_deepspeed_stage_2_converts_both_ways(moves):
    """ZeRO-2 keeps its partitions in another layout than ZeRO-3: it loads every checkpoint,
    and its own loads under fsdp and ZeRO-3."""
    results, _ = moves
    for job in ALL:
        _check_continued(results[("deepspeed_stage_2", 1)][job], job.split(":")[1], 1)
    for loader in ("fsdp", "deepspeed_stage_3"):
        _check_continued(results[(loader, 1)]["load:Z2"], "Z2", 1)


@needs_deepspeed
def test_a_deepspeed_checkpoint_loads_without_deepspeed(moves):
    results, _ = moves
    assert results[("single", 1)]["load:Z"]["deepspeed_imported"] is False


@pytest.mark.parametrize("name", ["F", pytest.param("Z", marks=needs_deepspeed), "H"])
def test_a_folder_consolidates_into_the_file_the_other_strategies_write(moves, tmp_path, name):
    _, folder = moves
    lite.consolidate_checkpoint(folder / name, tmp_path / "one.pt")
    whole = torch.load(tmp_path / "one.pt", weights_only=True)
    (steps,), params = reference([(SAVED[name][1], 0)])
    assert sorted(whole) == ["loader", "model", "note", "opt", "step"] and whole["step"] == len(steps)
    assert sorted(whole["model"]) == sorted(params)
    for key, value in params.items():
        assert torch.allclose(whole["model"][key], value, rtol=1e-5, atol=1e-6), key
    model = make_net(1)
    opt = make_optimizer(model)
    assert sorted(lite.load(tmp_path / "one.pt", {"model": model, "opt": opt})) == ["loader", "note", "step"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(opt.state[p]["step"].item() == whole["step"] for p in model.parameters())


def test_an_hsdp_checkpoint_moves_to_and_from_every_strategy(moves):
    """HSDP (2 replicas of 2 shards on 4 ranks) continues every checkpoint saved on 1 and 2
    processes and its own; its folder continues under single, ddp, fsdp on 1, 2 and 3 ranks,
    ZeRO-2 and ZeRO-3 on one process and ZeRO-1 on 2 ranks."""
    results, _ = moves
    for name in ("S", "D", "F", "Z", "H"):
        _check_continued(results[("hsdp", 4)][f"load:{name}"], name, 4)
    for loader, world_size in [
        ("single", 1),
        ("ddp", 2),
        ("fsdp", 1),
        ("fsdp", 2),
        ("fsdp", 3),
        ("deepspeed_stage_2", 1),
        ("deepspeed_stage_3", 1),
        ("deepspeed_stage_1", 2),
    ]:
        _check_continued(results[(loader, world_size)]["load:H"], "H", world_size)


@pytest.mark.parametrize(
    "loader,checkpoint",
    [
        ("fsdp", "FB"),
        pytest.param("fsdp", "ZB", marks=needs_deepspeed),
        pytest.param("deepspeed_stage_3", "FB", marks=needs_deepspeed),
    ],
)
def test_loading_a_sharded_checkpoint_never_needs_the_whole_model(moves, loader, checkpoint):
    """Eight 4 MB parameters, 96 MB with AdamW's moments; each of 2 ranks holds half. What
    reading the checkpoint needed beyond what the run keeps stays under 16 MB (half of the
    parameters alone), whereas reading any whole model or moment set would take 32 MB."""
    results, _ = moves
    ranks = results[(loader, 2)][f"bigload:{checkpoint}"]["ranks"]
    assert len(ranks) == 2
    for needed, _, kept in ranks:
        print(f"{loader} <- {checkpoint}: {needed / 2**20:.1f} MB needed beyond what the run keeps")
        assert abs(kept - 32 * 2**20) < 2**10  # each rank's half of the two moments (and step counts)
        assert needed < 16 * 2**20, f"{needed / 2**20:.1f} MB needed beyond what the run keeps"


@pytest.mark.parametrize("loader", _strategies([(s,) for s in [*MATRIX, "deepspeed_stage_2", "deepspeed_stage_1"]]))
def test_a_plain_torch_state_dict_file_loads_into_the_model_under_every_strategy(moves, loader):
    """``torch.save(model.state_dict())`` (bare, or with DDP's ``module.`` prefix) into
    ``{"model": model}``; a plain torch dict of the model's and AdamW's state dicts and an
    epoch into ``{"model": model, "optimizer": opt}``: the parameters right after loading are
    the plain model's, and a pass continues as plain torch does (with a fresh optimizer for a
    bare state dict; the set-up loader starts at its epoch 0)."""
    results, _ = moves
    world_size = {"deepspeed_stage_2": 1, "deepspeed_stage_1": 2}.get(loader, MATRIX.get(loader))
    (saved,), params = reference([(1, 0)])
    for name in ("P", "PD", "PN"):
        result = results[(loader, world_size)][f"plain:{name}"]
        assert sorted(result["loaded"]) == sorted(params), (loader, name)
        for key, value in params.items():
            assert torch.allclose(torch.tensor(result["loaded"][key]), value.flatten(), rtol=1e-6, atol=1e-7), (
                loader,
                name,
                key,
            )
        (_, then), _ = reference([(1, 0), (world_size, 0)], fresh_optimizer=name != "PN")
        assert _close(result["losses"], then) < 1e-6, (loader, name, result["losses"], then)
        assert result["rest"] == ({"epoch": 3} if name == "PN" else {}), (loader, name)


@pytest.mark.parametrize("loader", _strategies([(s,) for s in PATHS]))
def test_a_path_that_differs_between_ranks_is_refused_on_every_rank(moves, loader):
    """Each rank's own folder (``tempfile.mkdtemp()`` at the top of the script): save and
    load raise on every rank, naming each rank's path, before anything is written; the fix
    the error names (``lite.broadcast(path)``) saves and loads, and the same path written
    relative on one rank and absolute on the other is the same path."""
    results, folder = moves
    name = PATHS[loader]
    result = results[(loader, 2)][f"paths:{name}"]
    ranks = [f"rank {r}: {str(folder / f'{name}-rank{r}' / 'ckpt')!r}" for r in range(2)]
    assert len(result["errors"]) == 2
    for rank, errors in enumerate(result["errors"]):
        for call in ("save", "load"):
            message = errors[call]
            assert message is not None, (
                f"{loader}: rank {rank}'s lite.{call} accepted a path that differs between ranks"
            )
            assert message.startswith(f"lite.{call}: the path differs between ranks"), message
            assert all(r in message for r in ranks) and "path = lite.broadcast(path)" in message, message
    assert result["written"] == []  # refused before anything was written, on any rank
    assert result["fixed"] == [f"{name}-rank0"]
    assert result["rest"] == {}


@pytest.mark.parametrize("name", list(SAVED_IN_BACKGROUND))
def test_a_background_save_holds_the_state_at_the_call_and_keeps_it_through_failed_writes(moves, name):
    """``lite.save(path, state, blocking=False)`` after epoch 0, then epoch 1 trained, the
    learning rate and the note changed, before anything waited: what a fresh model loads is
    plain torch's state after epoch 0 (parameters, AdamW's moments and step counts, the
    loader's position, the note), so its epoch 1 gives the uninterrupted run's losses. A
    ``lite.load`` waited for it. Then two background saves to the same path whose write
    failed on rank 0: ``handle.wait()`` raised on both ranks, naming rank 0 and its error,
    and so did the save after the second; the path still held the first checkpoint (the
    load above ran after them), and nothing else was left in the folder."""
    results, _ = moves
    strategy, world_size = SAVED_IN_BACKGROUND[name]
    saved = results[(strategy, world_size)][f"async:{name}"]
    (first,), _ = reference([(world_size, 0)])
    assert _close(saved["losses"], first) < 1e-6
    assert saved["waited"] == [f"<lite.SaveHandle {str(moves[1] / name)!r} written>", True, len(first)]
    assert len(saved["errors"]) == world_size
    for rank, errors in enumerate(saved["errors"]):
        assert sorted(errors) == ["next_save", "wait"], (rank, errors)
        for message, cause in errors.values():
            assert message.startswith(
                f"lite.save({str(moves[1] / name)!r}, blocking=False) failed in the background on rank 0 "
            ), message
            assert "Can't pickle" in message and "it still holds the previous checkpoint" in message, message
            # on rank 0 its own error (torch.save's) is the cause
            assert (cause in ("PicklingError", "AttributeError")) if rank == 0 else cause == "NoneType", (rank, cause)
    assert saved["left"] == []
    _check_continued(results[(strategy, world_size)][f"load:{name}"], name, world_size)


def test_deepspeed_refuses_a_background_save_naming_the_fix(moves):
    results, _ = moves
    message = results[("deepspeed_stage_3", 2)]["async:ZA"]["refused"]
    assert "blocking=False) is not available under strategy='deepspeed'" in message, message
    assert "`lite.save(path, state)`" in message and "'fsdp'" in message, message


@pytest.mark.parametrize("name,strategy", [("DI", "ddp"), ("FI", "fsdp")])
def test_the_end_of_the_launch_block_waits_for_a_background_save(moves, name, strategy):
    """The last job of a 2-rank launch saved with ``blocking=False`` and nothing waited: the
    block's end did, on every rank (under fsdp rank 1 writes its shards), so the checkpoint is
    complete: it loads here, in one process, into plain torch's model after epoch 0."""
    _, folder = moves
    _, params = reference([(2, 0)])
    model = make_net(1)
    state = {"model": model, "opt": make_optimizer(model), "step": 0}
    assert lite.load(folder / name, state) == {}
    assert state["step"] == 3
    for key, value in params.items():
        assert torch.allclose(model.state_dict()[key], value, rtol=1e-5, atol=1e-6), (strategy, key)
    assert not [p.name for p in folder.iterdir() if p.name.startswith(f".{name}")]  # no temporary left


def test_a_zero1_checkpoint_continues_exactly_under_the_other_strategies(moves):
    """ZeRO-1's folder (its optimizer partitioned, its parameters whole) into ddp on 2 ranks,
    and single and fsdp on one process (single without importing DeepSpeed)."""
    results, _ = moves
    for loader, world_size in (("ddp", 2), ("single", 1), ("fsdp", 1)):
        _check_continued(results[(loader, world_size)]["load:Z1"], "Z1", world_size)
    assert results[("single", 1)]["load:Z1"]["deepspeed_imported"] is False


@pytest.mark.parametrize("name", list(MID_EPOCH))
def test_a_loader_saved_mid_epoch_continues_with_its_next_batch_under_another_strategy(moves, name):
    """Saved after the first of epoch 0's 3 steps (ddp's file, ZeRO-3's folder), loaded into
    a model with other values under other strategies on 2 ranks: the losses of the rest of
    epoch 0 and of epoch 1 are plain torch's uninterrupted ones, each rank reading what
    torch's DistributedSampler gives it, from the batch after the saved one."""
    results, _ = moves
    saver, loaders = MID_EPOCH[name]
    (first, second), _ = reference([(2, 0), (2, 1)])
    assert len(first) == 3
    assert _close(results[(saver, 2)][f"midsave:{name}"]["losses"], first) < 1e-6, saver
    for loader in loaders:
        got = results[(loader, 2)][f"midload:{name}"]
        assert got["step"] == 1, loader
        assert _close(got["rest_of_epoch"], first[1:]) < 1e-6, (loader, got["rest_of_epoch"], first[1:])
        assert _close(got["next_epoch"], second) < 1e-6, (loader, got["next_epoch"], second)
