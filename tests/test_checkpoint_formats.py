"""Reading checkpoints in the canonical form, in this process (issue 23).

The formats themselves are read for real by tests/test_checkpoint_moves.py (every strategy's
checkpoint under every other); here: parts of tensors, optimizer states named through the
optimizer they load into, the refusals, and how a DeepSpeed flat partition is filled from
each parameter's slice (with plain tensors standing for DeepSpeed's partitions); files plain
torch wrote (a bare state dict, wrapped models' prefixes, entries named their own way) and
the refusals whose suggested line each test runs as written.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import scopedlite as lite
from conftest import SCRIPTS
from scopedlite._io.canonical import Box, read_flat
from scopedlite._io.reader import open_checkpoint
from scopedlite._private.deepspeed_internals import ZeroSlot
from scopedlite._strategies.deepspeed.checkpoint import _load_partition

sys.path.insert(0, str(SCRIPTS))
from _common import assert_close


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(
        [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias], "lr": 0.5}]
    )
    for _ in range(2):
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_parts_of_a_tensor_are_read_by_box_and_by_flat_range(tmp_path):
    whole = torch.arange(60.0).reshape(5, 3, 4)
    lite.save(tmp_path / "c.pt", {"model": {"w": whole}})
    with open_checkpoint(tmp_path / "c.pt") as checkpoint:
        tensors = checkpoint.module("model")
        assert torch.equal(tensors.read("w", Box((1, 0, 2), (3, 2, 2))), whole[1:4, 0:2, 2:4])
        assert torch.equal(read_flat(tensors, "w", 7, 31), whole.reshape(-1)[7:31])
        assert read_flat(tensors, "w", 9, 9).numel() == 0


def test_an_optimizer_saved_by_position_is_named_through_the_optimizer_it_loads_into(tmp_path):
    model, opt = _trained()
    lite.save(tmp_path / "c.pt", {"opt": opt})
    names = [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    with open_checkpoint(tmp_path / "c.pt") as checkpoint:
        entry = checkpoint.optimizer("opt")
        assert entry.keyed_by_position
        named = entry.by_name([n for group in names for n in group])
        named.check_groups(names)
        assert [g["params"] for g in named.param_groups] == names
        assert named.hyperparameters(1)["lr"] == 0.5
        moment = named.tensors.read(("1.bias", "exp_avg"))
        assert torch.equal(moment, opt.state[model[1].bias]["exp_avg"])
        assert torch.equal(named.state["0.weight"]["step"], opt.state[model[0].weight]["step"])
        with pytest.raises(lite.CheckpointError, match="other parameters than the optimizer"):
            named.check_groups([["0.weight", "0.bias"], ["1.weight", "1.bias"]])
        with pytest.raises(lite.CheckpointError, match="covers 4 parameters.*holds 3"):
            entry.by_name(["a", "b", "c"])


def test_a_whole_checkpoint_in_one_file_is_what_lite_load_returns_without_state(tmp_path):
    model, opt = _trained()
    lite.save(tmp_path / "c.pt", {"model": model, "opt": opt, "step": 2})
    whole = lite.load(tmp_path / "c.pt")
    assert whole["step"] == 2 and set(whole["model"]) == set(model.state_dict())
    with pytest.raises(lite.CheckpointError, match="needs no consolidation"):
        lite.consolidate_checkpoint(tmp_path / "c.pt", tmp_path / "d.pt")


def test_optimizer_states_load_by_position_or_by_name_into_a_plain_optimizer(tmp_path):
    model, opt = _trained()
    lite.save(tmp_path / "c.pt", {"model": model, "opt": opt})
    fresh, fresh_opt = _trained(seed=1)
    lite.load(tmp_path / "c.pt", {"model": fresh, "opt": fresh_opt})  # by position: as torch does
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b) and torch.equal(fresh_opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])

    # keyed by name (as in a folder): the names come from the model loaded with it
    names = {id(p): n for n, p in model.named_parameters()}
    saved = opt.state_dict()
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    named = {
        "state": {order[i]: v for i, v in saved["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
    torch.save({"model": model.state_dict(), "opt": named}, tmp_path / "named.pt")
    fresh, fresh_opt = _trained(seed=1)
    with pytest.raises(lite.CheckpointError, match="together with its model"):
        lite.load(tmp_path / "named.pt", {"opt": fresh_opt}, strict=False)
    lite.load(tmp_path / "named.pt", {"model": fresh, "opt": fresh_opt})
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(fresh_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def _partition(params: list[torch.nn.Parameter], rank: int, world: int) -> tuple[torch.Tensor, list[ZeroSlot]]:
    """A ZeRO-3-like flat partition: each parameter's ceil(numel / world) elements of ``rank``."""
    slots, offset = [], 0
    sizes = [-(-p.numel() // world) for p in params]
    flat = torch.zeros(sum(sizes))
    for param, size in zip(params, sizes):
        start = min(rank * size, param.numel())
        slots.append(ZeroSlot(param, flat, offset, start, max(0, min(size, param.numel() - start)), 0))
        offset += size
    return flat, slots


def test_a_deepspeed_partition_takes_each_parameters_slice_of_every_moment(tmp_path):
    model, opt = _trained()
    lite.save(tmp_path / "c.pt", {"opt": opt})
    weights = [model[0].weight, model[1].weight]
    with open_checkpoint(tmp_path / "c.pt") as checkpoint:
        entry = checkpoint.optimizer("opt").by_name(["0.weight", "1.weight", "0.bias", "1.bias"])
    for rank in range(3):
        flat, slots = _partition(weights, rank, world=3)
        inner = torch.optim.AdamW([flat])
        _load_partition(inner, entry, list(zip(["0.weight", "1.weight"], slots)))
        for slot, weight in zip(slots, weights):
            expected = opt.state[weight]["exp_avg_sq"].reshape(-1)[slot.start : slot.start + slot.numel]
            assert torch.equal(inner.state[flat]["exp_avg_sq"][slot.offset : slot.offset + slot.numel], expected)
        assert torch.equal(inner.state[flat]["step"], opt.state[weights[0]]["step"])


def test_a_deepspeed_partition_refuses_step_counts_that_differ(tmp_path):
    model, opt = _trained()
    opt.state[model[1].weight]["step"] += 1  # this parameter stepped once more
    lite.save(tmp_path / "c.pt", {"opt": opt})
    weights = [model[0].weight, model[1].weight]
    with open_checkpoint(tmp_path / "c.pt") as checkpoint:
        entry = checkpoint.optimizer("opt").by_name(["0.weight", "1.weight", "0.bias", "1.bias"])
    flat, slots = _partition(weights, 0, world=2)
    with pytest.raises(lite.CheckpointError, match="one 'step' for parameters.*differ"):
        _load_partition(torch.optim.AdamW([flat]), entry, list(zip(["0.weight", "1.weight"], slots)))


def _same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert_close({k: v.tolist() for k, v in got.items()}, {k: v.tolist() for k, v in expected.items()}, 0.0, what)


def _suggested(message: str) -> str:
    """The ``lite.load(path, {...})`` line an error suggests (the test runs it as written)."""
    match = re.search(r"lite\.load\(path, \{[^}]*\}\)", message)
    assert match, f"no lite.load line suggested in: {message}"
    return match.group(0)


class _Holder(torch.nn.Module):
    """A model whose own submodule is called ``module``: its keys start with "module."."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(3, 2)


def test_a_plain_state_dict_file_loads_into_the_one_module_of_state(tmp_path):
    """``torch.save(model.state_dict())``, the same from DataParallel / DDP ("module.") and
    from a compiled model ("_orig_mod."): the weights land in the module, nothing else returns."""
    model, _ = _trained()
    wrapped = {"P": model, "PD": torch.nn.DataParallel(model), "PC": torch.compile(model)}
    for name, saved in wrapped.items():
        torch.save(saved.state_dict(), tmp_path / name)
        fresh, _ = _trained(seed=1)
        assert lite.load(tmp_path / name, {"model": fresh}) == {}
        _same(fresh.state_dict(), model.state_dict(), name)
    holder = _Holder()
    torch.save(holder.state_dict(), tmp_path / "H")  # keys "module.weight", "module.bias": its own
    torch.manual_seed(1)
    fresh = _Holder()
    lite.load(tmp_path / "H", {"model": fresh})
    _same(fresh.state_dict(), holder.state_dict(), "a submodule called module")


def test_a_plain_state_dict_file_is_refused_where_it_cannot_be_told_and_each_fix_works(tmp_path):
    model, _ = _trained()
    path = tmp_path / "plain.pt"
    torch.save(model.state_dict(), path)

    fresh, opt = _trained(seed=1)
    with pytest.raises(KeyError, match=r"nothing for \['opt'\]") as refused:
        lite.load(path, {"model": fresh, "opt": opt})
    eval(_suggested(str(refused.value)), {"lite": lite, "path": path, "model": fresh})  # the line the error suggests
    _same(fresh.state_dict(), model.state_dict(), "the model loaded alone")
    fresh, opt = _trained(seed=1)
    moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    assert "strict=False" in str(refused.value)
    assert lite.load(path, {"model": fresh, "opt": opt}, strict=False) == {}  # the other fix
    _same(fresh.state_dict(), model.state_dict(), "the model loaded with strict=False")
    _same({k: v["exp_avg"] for k, v in opt.state_dict()["state"].items()}, moments, "the optimizer untouched")

    gen, _ = _trained(seed=1)
    disc = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="holds 2 modules") as refused:
        lite.load(path, {"gen": gen, "disc": disc})
    eval(_suggested(str(refused.value)), {"lite": lite, "path": path, "gen": gen})
    _same(gen.state_dict(), model.state_dict(), "the module the fix names")

    with pytest.raises(KeyError, match=r"not the entries \['step'\]") as refused:
        lite.load(path, {"step": 0})
    fresh, _ = _trained(seed=1)
    eval(_suggested(str(refused.value)), {"lite": lite, "path": path, "model": fresh})
    _same(fresh.state_dict(), model.state_dict(), "the model the fix names")
    assert sorted(lite.load(path, {"step": 0}, strict=False)) == sorted(model.state_dict())  # as from any file

    with pytest.raises(lite.CheckpointError, match="another module's state dict"):
        lite.load(path, {"model": torch.nn.Linear(2, 2)})


def test_entries_a_plain_torch_script_named_its_own_way_are_suggested_under_their_names(tmp_path):
    """PyTorch's tutorial saves ``model_state_dict`` and ``optimizer_state_dict``: loading it
    into ``{"model": ..., "optimizer": ...}`` names the line that loads it, which works
    (``strict=False`` would restore nothing of the model)."""
    model, opt = _trained()
    path = tmp_path / "tutorial.pt"
    torch.save(
        {"epoch": 3, "model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "loss": 0.5},
        path,
    )
    fresh, fresh_opt = _trained(seed=1)
    with pytest.raises(KeyError, match="under the checkpoint's names") as refused:
        lite.load(path, {"model": fresh, "optimizer": fresh_opt, "step": 0})
    suggested = re.search(r"lite\.load\(path, \{.*?\}\)", str(refused.value)).group(0)
    rest = eval(suggested, {"lite": lite, "path": path, "model": fresh, "optimizer": fresh_opt})
    assert rest == {"epoch": 3, "loss": 0.5}
    _same(fresh.state_dict(), model.state_dict(), "the model")
    _same(
        {str(k): v["exp_avg"] for k, v in fresh_opt.state_dict()["state"].items()},
        {str(k): v["exp_avg"] for k, v in opt.state_dict()["state"].items()},
        "the optimizer's moments",
    )
    with pytest.raises(KeyError, match=r"strict=False to restore the entries both have and leave \['step'\]"):
        lite.load(path, {"step": 0})
