"""sharded_init's recorded build, in one process: every tensor gets a plain build's value.

The multi-process runs (tests/test_fsdp.py, test_deepspeed.py, test_hf_models.py) use this
under FSDP and ZeRO-3; here the recording and the one-tensor-at-a-time replay are checked
directly against plain builds with the same seed, including what a plain build does that
``reset_parameters()`` alone does not: initialisation in ``__init__``, a parent changing its
children, Hugging Face's ``post_init()``, reseeding inside the block, values read while built.
"""

from __future__ import annotations

import pytest
import torch

from scopedlite._io.pretrained import PretrainedWeights
from scopedlite._strategies.deferred.build import DeferredBuild, NotReplayable
from scopedlite._strategies.deferred.tape import Ref


class Tricky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.nn.Linear(3, 3)  # built and dropped: its draws still move the generator
        self.w = torch.nn.Parameter(torch.randn(4, 5))  # no reset_parameters()
        self.b = torch.nn.Linear(5, 2)
        torch.manual_seed(3)  # reseeding inside the build
        self.a = torch.nn.Linear(2, 2)
        self.g = torch.nn.Parameter(torch.empty(3).normal_(generator=torch.Generator().manual_seed(5)))
        self.register_buffer("c", torch.arange(6.0).reshape(2, 3) * 0.5)
        self.rates = [x.item() for x in torch.linspace(0, 0.1, 3)]  # values read while built
        with torch.no_grad():  # a parent rewriting its children, through views
            self.b.weight[:, 0].normal_()
            self.a.weight.copy_(self.b.weight[:, :2])
        self.s = torch.nn.Parameter(torch.tensor([1.5, 2.5]))  # made from data
        self.h = torch.nn.Parameter(torch.ones(2, dtype=torch.float64) * 0.3)
        self.tied = self.b.weight


def _hf(kind: str) -> torch.nn.Module:
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from _hf_common import build, quiet

    quiet()
    return build(kind)


BUILDS = {"tricky": Tricky, "gpt2": lambda: _hf("gpt2"), "llama": lambda: _hf("llama")}


def _recorded(build, empty: bool = False) -> tuple[DeferredBuild, torch.nn.Module]:
    deferred = DeferredBuild(empty, agree=lambda obj: obj)
    with deferred.recording():
        model = build()
    return deferred, model


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_every_tensor_gets_the_plain_build_value_one_parameter_at_a_time(name):
    build = BUILDS[name]
    torch.manual_seed(0)
    plain = build()
    plain_next = torch.rand(3)
    torch.manual_seed(0)
    deferred, model = _recorded(build)
    assert torch.equal(torch.rand(3), plain_next)  # the generator is where the plain build left it
    assert any(p.is_meta for p in model.parameters())  # nothing was allocated
    expected = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
    built = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert sorted(built) == sorted(expected)
    parameter_keys = {Ref.of(p).key for p in model.parameters() if p.is_meta}
    for key, tensor in built.items():
        value = deferred.value(tensor)
        assert value.dtype == expected[key].dtype and torch.equal(value, expected[key]), key
        if name != "tricky" and isinstance(tensor, torch.nn.Parameter):
            # computed alone: no other parameter is materialised for it (in Tricky, `a.weight`
            # is copied from `b.weight`, which it then needs)
            entries = deferred.tape.needed({Ref.of(tensor).key})
            touched = set().union(*(deferred.tape.entries[i].creates for i in entries))
            assert touched & parameter_keys == {Ref.of(tensor).key}, key
    if name == "tricky":
        assert model.rates == plain.rates


def test_empty_keeps_deterministic_values_and_leaves_the_generator_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    deferred, model = _recorded(lambda: torch.nn.LayerNorm(4), empty=True)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(deferred.value(model.weight), torch.ones(4))


class Peeks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.positive = bool(self.w.sum() > 0)  # needs values drawn at random


def test_what_cannot_be_replayed_exactly_is_refused_with_the_ways_out():
    with pytest.raises(NotReplayable, match="drawn at random") as caught:
        _recorded(Peeks)
    assert "sharded_init(empty=True)" in str(caught.value) and "lite.load_pretrained" in str(caught.value)
    real = torch.zeros(3)
    with pytest.raises(NotReplayable, match="draws random numbers into a tensor that is not deferred"):
        _recorded(lambda: real.normal_())


def test_pretrained_weights_are_read_by_rows_and_flat_ranges(tmp_path):
    from safetensors.torch import save_file

    weight = torch.arange(35.0).reshape(7, 5)
    save_file({"w": weight, "s": torch.tensor(2.0)}, str(tmp_path / "model.safetensors"))
    weights = PretrainedWeights(tmp_path)
    assert weights.names() == {"w", "s"} and weights.shape("w") == (7, 5)
    assert torch.equal(weights.rows("w", 4, 7), weight[4:7])  # FSDP: rank 1 of 2 holds rows 4-6
    assert torch.equal(weights.flat("w", 18, 17), weight.flatten()[18:35])  # ZeRO-3: rank 1's range
    assert torch.equal(weights.flat("w", 3, 4), weight.flatten()[3:7])
    assert weights.full("s").item() == 2.0
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        PretrainedWeights(tmp_path / "..")
