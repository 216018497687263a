"""Every ability a strategy declares is used by the front end, for every strategy name.

An ability is what a strategy does its own way: a method of a protocol in
``scopedlite._strategies.abilities`` (its device feed, ``join``, ``no_backward_sync``, a joint
model-and-optimizer set-up, its own backward, its own checkpoint format), or a hook of the
``Strategy`` interface it overrides (XLA's precision check and its CPU checkpoints, FSDP's
sharded init, ...). A restructure of the front end that stops calling one falls back to the
generic path without an error: batches moved with ``.to(device)`` instead of XLA's parallel
loader, a state dict written instead of a sharded checkpoint. This test catches that for every
strategy at once.

For each name of ``launch(strategy=...)``, the strategy is built (not started), each of its
abilities is replaced on the instance by a recorder doing the plain thing, and one training
loop runs through the public API as rank 1 of 2 (the recorders stand in for communication),
then a checkpoint is saved and loaded as rank 0. Every ability the strategy has must have been
called. The feed's recorder reads the pass in a thread of its own, as XLA's does: inside
``lite.join`` the loop must still get the unpadded share. The hooks of the
launch machinery (``start``, ``stop``, ``backend``, ``fresh``, ``comm_device``, ``describe``,
``unwrap``) are outside this check: no run starts without them, and the launch tests run them.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import scopedlite as lite
from scopedlite._core.precision import PRECISIONS
from scopedlite._core.run import Placement, Run, launch_var
from scopedlite._hardware.machine import Machine
from scopedlite._io.background import BackgroundSaves
from scopedlite._plan import resolve
from scopedlite._strategies import abilities
from scopedlite._strategies.base import Strategy
from scopedlite._strategies.loading import load_module, load_optimizer, parameter_names
from scopedlite._strategies.registry import STRATEGIES
from scopedlite._strategies.weights import load_weights

PROTOCOLS = [getattr(abilities, name) for name in abilities.__all__]


def _read_in_a_thread(batches: Any) -> Iterator[Any]:
    """A device feed that reads the whole pass in a thread of its own, as XLA's does."""
    read: list[Any] = []
    reader = threading.Thread(target=lambda: read.extend(batches))
    reader.start()
    reader.join()
    yield from read


def _protocol_methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if not name.startswith("_") and callable(value)]


# What each ability's recorder does: the plain thing, so that the loop goes on.
PLAIN: dict[str, Callable[..., Any]] = {
    # abilities (protocols)
    "device_batches": lambda batches: _read_in_a_thread(batches),
    "join": lambda joinables, divide_by_initial_world_size: None,  # a _Session (see _probe)
    "no_backward_sync": lambda module, enabled: contextlib.nullcontext(),
    "setup_module_and_optimizers": lambda module, optimizers: (module, list(optimizers)),
    "backward_model": lambda loss, model, *args, **kwargs: loss.backward(*args, **kwargs),
    # the strategy's own format stands in as a plain file, which lite.load then reads back
    "save_checkpoint": lambda path, state: torch.save(
        {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}, path
    ),
    "load_native": lambda checkpoint, state, strict: [],
    # lite.save(..., blocking=False) under its own format: written now, nothing left to do
    "start_checkpoint": lambda path, state, staging: torch.save(
        {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}, path
    ),
    # hooks of the Strategy interface that a strategy overrides to do its own thing
    "check": lambda accelerator, world_size, precision: None,
    "module_init_context": lambda empty: contextlib.nullcontext(),
    "setup_module": lambda module: module,
    "setup_optimizer": lambda optimizer: optimizer,
    "backward": lambda loss, *args, **kwargs: loss.backward(*args, **kwargs),
    "clips_together": lambda by_norm: False,  # lite.clip_gradients asks before it checks the ranks
    "note_clip": lambda how: None,  # lite.clip_gradients, outside lite.join, before it clips
    "clip_gradients": lambda module, optimizer, max_norm, clip_val, norm_type=2.0: None,
    "module_state": lambda module: module.state_dict(),
    "optimizer_state": lambda optimizer: optimizer.state_dict(),
    "load_module_from": lambda module, tensors, strict: load_module(module, tensors, strict),
    "load_optimizer_from": lambda optimizer, entry, modules: load_optimizer(
        optimizer, entry, parameter_names(optimizer, list(modules))
    ),
    "load_weights": lambda module, weights, strict: load_weights(module, weights, strict),
    "compile_target": lambda module: module,
    "all_reduce": lambda tensor, op: tensor.clone(),
    "all_gather": lambda tensor: torch.stack([tensor, tensor]),
    "all_reduce_replicas": lambda tensor, op: tensor.clone(),
    "all_gather_replicas": lambda tensor: torch.stack([tensor, tensor]),
    "broadcast": lambda obj, src: obj,
    "barrier": lambda: None,
    "every_rank_calls": lambda call, why, fix, alone=None: (
        None
    ),  # lite.save, lite.setup, ..., before their first collective
    "collective_called": lambda call: None,  # lite.all_reduce, ..., outside lite.join
}
LAUNCH_HOOKS = {
    "start",
    "place",
    "stop",
    "backend",
    "fresh",
    "comm_device",
    "describe",
    "unwrap",
    "block_body_ended",
    "waiting_at_end",
}
# Where this process's share of the data is: read by setup_dataloader and lite.save through the
# Run (properties, which no recorder replaces); tests/test_model_parallel.py checks the one
# strategy that overrides them.
PLACEMENT_FACTS = {"data_parallel_rank", "data_parallel_size"}
# Strategies whose placement facts need a started run (model_parallel's come from its device
# mesh): probed with a subclass that reads them from the placement, as every other strategy
# does (tests/test_model_parallel.py checks the mesh's own).
FACTS_FROM_PLACEMENT = {"model_parallel"}
PROTOCOL_METHODS = {m for p in PROTOCOLS for m in _protocol_methods(p)}
INTERFACE_HOOKS = {hook for hook in PLAIN if hasattr(Strategy, hook)}

# Overrides the front end reaches only through another ability of the same strategy (by
# class), each with that ability: under FSDP, lite.save/lite.load go to its own checkpoint
# format, whose full (one-file) form converts modules and optimizers with these hooks
# (fsdp/checkpoint.py, through _io.files.state_dicts / restore), and so does model_parallel's;
# under DeepSpeed, lite.backward calls backward_model, of which backward is the interface's form.
REACHED_THROUGH = {
    ("FSDPStrategy", "module_state"): "save_checkpoint",
    ("FSDPStrategy", "optimizer_state"): "save_checkpoint",
    ("ModelParallelStrategy", "module_state"): "save_checkpoint",  # FSDP's format
    ("ModelParallelStrategy", "optimizer_state"): "save_checkpoint",
    # lite.all_gather counts replicas there: it gathers through all_gather (model_parallel/strategy.py)
    ("ModelParallelStrategy", "all_gather"): "all_gather_replicas",
    ("DeepSpeedStrategy", "backward"): "backward_model",
}

# Public methods of strategy classes that are no ability: called by the strategy's own parts.
OWN_HELPERS = {
    "join_models": "the join template's hook (process_group_strategy.py): the models join may take",
    "join_optimizers": "the join template's hook: the optimizers a join mirrors",
    "join_hook": "the join template's hook: the backend's replays",
    "join_replicas": "the join template's hook: which ranks form each data-parallel replica",
    "engine": "deepspeed: the engine behind a set-up model, for the user (docs: Real models)",
    "optimizer_of": "deepspeed: a model's optimizer, for its checkpoint, join and backward",
    "model_of": "deepspeed: an optimizer's model, for its checkpoint conversion",
    "owner_of": "fsdp: the FSDP root of an optimizer, for its checkpoints and join",
    "build_config": "deepspeed: the engine's config, at setup",
    "note_synced": "deepspeed: a joined rank's replayed backward gives the next step its gradients",
    "note_collective": "sharded strategies: join rounds note themselves in the gather ledger (lockstep.py)",
    "cannot_go_on": "process-group strategies: the join session ends a rank that left the others in their gathers",
    "join_left": "sharded strategies: the gather ledger starts its counts again after a join block",
    "syncs_buffers": "ddp: whether a model broadcasts its buffers, read by its join replays",
    "checkpoint_group": "fsdp: the gloo group its background saves talk over (fsdp/checkpoint.py)",
}


def _abilities_of(cls: type[Strategy]) -> list[str]:
    """The abilities ``cls`` has: the methods of the protocols it declares, and the hooks of
    the interface it overrides."""
    declared = [m for p in PROTOCOLS if issubclass(cls, p) for m in _protocol_methods(p)]
    overridden = [hook for hook in sorted(INTERFACE_HOOKS) if getattr(cls, hook) is not getattr(Strategy, hook, None)]
    return declared + overridden


class _Session(contextlib.nullcontext):  # type: ignore[type-arg]
    """A join session that hands the work done inside ``lite.join`` (clipping, collectives)
    to the strategy, as the real sessions do in the end."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__()
        self.strategy = strategy

    def loader_pass(self, length: int | None) -> None:
        """No cursor: the loader's batches are not counted by this session (as ``NoJoin``)."""
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.strategy, name)


def _probe(name: str) -> tuple[Strategy, list[str]]:
    """The strategy of ``name``, unstarted, its abilities replaced by recorders; and the list
    the recorders append the name of each ability called to."""
    entry = STRATEGIES[name]
    cls = entry.cls
    if name in FACTS_FROM_PLACEMENT:
        facts = {fact: getattr(Strategy, fact) for fact in PLACEMENT_FACTS}
        cls = type(cls.__name__, (cls,), facts)
    strategy = cls(**entry.options)
    called: list[str] = []
    for hook in _abilities_of(type(strategy)):

        def recorder(*args: Any, _hook: str = hook, **kwargs: Any) -> Any:
            called.append(_hook)
            return _Session(strategy) if _hook == "join" else PLAIN[_hook](*args, **kwargs)

        setattr(strategy, hook, recorder)
    strategy.unwrap = lambda module: module  # type: ignore[method-assign]
    return strategy, called


@contextlib.contextmanager
def _as_rank_of_two(strategy: Strategy, rank: int) -> Iterator[Run]:
    placement = Placement(rank, rank, 0, 2, 2, torch.device("cpu"), PRECISIONS["32-true"], "cpu")
    strategy.place(placement)  # what every start does first: the run's place and registry
    run = Run.of(placement, strategy)

    class Scope:
        pass

    scope = Scope()
    scope.run = run  # type: ignore[attr-defined]
    scope.saves = BackgroundSaves()  # type: ignore[attr-defined]  # lite.save(..., blocking=False)'s
    token = launch_var.set(scope)
    try:
        yield run
    finally:
        launch_var.reset(token)
        scope.saves.close(every_rank=True)  # type: ignore[attr-defined]


def _train(strategy: Strategy) -> list[list[int]]:
    """The loop a user writes, every part of the API that hands work to the strategy; returns
    the sample indices of the batches the loop got."""
    seen: list[list[int]] = []
    with lite.sharded_init():
        model = torch.nn.Linear(2, 1)
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # a second model set up the other way: module, then optimizer
    critic = lite.setup_module(torch.nn.Linear(2, 1))
    lite.setup_optimizers(torch.optim.SGD(critic.parameters(), lr=0.1))
    data = [(torch.full((2,), float(i)), torch.tensor([float(i)]), i) for i in range(9)]
    loader = lite.setup_dataloader(DataLoader(data, batch_size=2))
    joins = isinstance(strategy, abilities.SupportsJoin)
    syncs = isinstance(strategy, abilities.SupportsNoBackwardSync)
    with lite.join(model) if joins else contextlib.nullcontext():
        for x, y, i in loader:
            seen.append(i.tolist())
            with lite.no_backward_sync(model) if syncs else contextlib.nullcontext():
                lite.backward(torch.nn.functional.mse_loss(model(x), y))
            lite.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
    lite.clip_gradients(model, opt, clip_val=1.0)  # outside lite.join: noted for the next step
    t = torch.tensor([1.0])
    lite.all_reduce(t), lite.all_gather(t), lite.broadcast({"a": 1}, src=0), lite.barrier()
    return seen


def _checkpoint(path: Any) -> None:
    """Save and load, pretrained weights, and a compiled model set up (never called: setting
    it up is what reaches the strategy)."""
    from safetensors.torch import save_file

    plain = torch.nn.Linear(2, 1)
    model, opt = lite.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    lite.save(path / "ckpt", {"model": model, "opt": opt})
    lite.load(path / "ckpt", {"model": model, "opt": opt})
    try:  # in the background: the strategy's own format, where it has one that can
        lite.save(path / "background", {"model": model, "opt": opt}, blocking=False).wait()
    except ValueError as e:  # deepspeed: refused (tests/test_checkpoint_moves.py checks the message)
        assert "blocking=False) is not available" in str(e)
    save_file({k: v.detach().clone() for k, v in torch.nn.Linear(2, 1).state_dict().items()}, path / "w.safetensors")
    lite.load_pretrained(model, path / "w.safetensors")
    lite.setup(torch.compile(torch.nn.Linear(2, 1), backend="eager"))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_front_end_uses_every_ability_the_strategy_has(name, tmp_path):
    strategy, called = _probe(name)
    cls = type(strategy)
    accelerator = "xla" if "xla" in cls.accelerators else "cpu"
    machine = Machine(cpu_count=4, xla_device_count=1, has_script=False)
    devices = 1 if not cls.multi_process or accelerator == "xla" else 2
    resolve(accelerator=accelerator, strategy=strategy, devices=devices, env={}, machine=machine)
    with _as_rank_of_two(strategy, 1):
        seen = _train(strategy)
    with _as_rank_of_two(strategy, 0):
        _checkpoint(tmp_path)
    expected = {hook for hook in _abilities_of(cls) if (cls.__name__, hook) not in REACHED_THROUGH}
    dropped = sorted(expected - set(called))
    assert not dropped, (
        f"strategy={name!r} has {dropped} but the front end no longer calls "
        f"{'it' if len(dropped) == 1 else 'them'}: the generic path ran instead"
    )
    # Reached-through entries name an ability the strategy has, which is itself checked above.
    for (owner, hook), via in REACHED_THROUGH.items():
        if owner == cls.__name__:
            assert via in called, (name, hook, via)
    # Through a feed too, the loop gets this rank's share of the 9 samples: inside lite.join
    # every sample once (rank 1: 1, 3, 5, 7), outside it padded as plain torch's
    # DistributedSampler pads (rank 1 of 2, no shuffle: 1, 3, 5, 7, 0).
    padded = list(DistributedSampler(range(9), num_replicas=2, rank=1, shuffle=False))
    share = list(range(9))[1::2] if isinstance(strategy, abilities.SupportsJoin) else padded
    assert [i for batch in seen for i in batch] == share


def test_every_ability_has_a_use_in_the_loop():
    """A new protocol, or a new hook of the interface, must be added to the loop above (and
    its recorder to PLAIN), or strategies could declare it with nothing checking its use."""
    missing = sorted(PROTOCOL_METHODS - set(PLAIN))
    assert not missing, f"abilities without a recorder and a use in the loop: {missing}"
    interface = {
        name
        for name, value in vars(Strategy).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }
    unchecked = sorted(interface - INTERFACE_HOOKS - LAUNCH_HOOKS - PLACEMENT_FACTS)
    assert not unchecked, f"Strategy hooks neither checked here nor launch machinery: {unchecked}"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_no_strategy_method_goes_unused(name):
    """A public method of a strategy that is neither an ability, nor a hook of the interface,
    nor a helper its own parts call, is one nothing calls: typically an ability whose
    protocol was renamed or removed, so the strategy no longer declares it."""
    cls = STRATEGIES[name].cls
    known = PROTOCOL_METHODS | INTERFACE_HOOKS | LAUNCH_HOOKS | PLACEMENT_FACTS | set(OWN_HELPERS)
    stray = sorted(
        member
        for klass in cls.__mro__
        if klass not in (Strategy, object)
        for member, value in vars(klass).items()
        if not member.startswith("_") and inspect.isfunction(value) and member not in known
    )
    assert not stray, (
        f"strategy={name!r} defines {stray}, which the front end never calls: declare the "
        "ability in scopedlite/_strategies/abilities.py and use it, or make the method private"
    )


def test_join_under_a_strategy_without_it_names_the_strategies_that_have_it():
    """SPEC 5: a strategy with no join mechanism refuses ``lite.join`` with the strategies that
    support it. ``xla`` (several XLA processes) is the one; its class is built unstarted here,
    so this runs without torch_xla (tests/test_xla.py runs it for real in the XLA venv)."""
    strategy = STRATEGIES["xla"]()
    assert not isinstance(strategy, abilities.SupportsJoin)
    with _as_rank_of_two(strategy, 0), pytest.raises(RuntimeError) as refused, lite.join():
        pytest.fail("the block ran")
    supporting = (
        "'single', 'ddp', 'ddp_fork', 'ddp_notebook', 'fsdp', 'hsdp', 'model_parallel', 'deepspeed', "
        "'deepspeed_stage_1', 'deepspeed_stage_2', 'deepspeed_stage_2_offload', 'deepspeed_stage_3', "
        "'deepspeed_stage_3_offload', 'xla_single'"
    )
    assert str(refused.value) == (
        f"lite.join is not available under strategy='xla'. Strategies that support it: {supporting}."
    )
