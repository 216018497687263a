"""DeepSpeed checkpoints: the engine's own folder, written atomically; any checkpoint loaded.

``lite.save`` under DeepSpeed writes the engine's checkpoint (every rank its shard) under a
temporary name and renames it into place once every rank is done; the entries of the state
that are not the engine and its optimizer travel as DeepSpeed's client state, with a record
of which keys the engine and optimizer were (``_io.deepspeed_format`` reads it all back,
without DeepSpeed, under any strategy).

``lite.load`` under DeepSpeed:

- a DeepSpeed checkpoint of the same ZeRO stage and world size is loaded by the engine
  itself (``engine.load_checkpoint``, which also restores its own counters and loss scale);
- any other checkpoint (a file, FSDP's shards, DeepSpeed's at another world size or stage)
  is converted as it is read: each rank writes its part of each parameter into the engine's
  low-precision copy and fp32 master copy, and of each moment into the optimizer's flat
  state, reading only that part (see ``_private.deepspeed_internals.zero_slots``).

Why our own conversion rather than DeepSpeed's universal checkpoint (``ds_to_universal`` and
``load_universal_checkpoint``): DeepSpeed reads a universal checkpoint only when its config
said so before ``deepspeed.initialize`` (the script would have to know it is resuming from
another layout); ``ds_to_universal`` is an offline step over a DeepSpeed folder only, that
writes a second full copy of the model and moments to disk (the user would run a conversion,
and checkpoints from DDP or FSDP would need a writer of that format anyway); and its loader
reads each parameter whole on every rank. The conversion here needs no step, goes both
ways, and reads slices.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scopedlite._io.canonical import Checkpoint, OptimizerEntry, TensorInfo, Tensors, kinds_of, read_flat
from scopedlite._io.deepspeed_format import CLIENT_KEY, TAG, DeepSpeedFolder, client_state
from scopedlite._io.files import CheckpointError, swap_folder_into_place
from scopedlite._private.deepspeed_internals import (
    ZeroSlot,
    full_shape,
    write_zero3_partition,
    zero3_partition,
    zero_slots,
)
from scopedlite._strategies.deepspeed.logs import filtered_warnings
from scopedlite._strategies.loading import check_keys, check_shape, load_module, load_optimizer

if TYPE_CHECKING:
    from scopedlite._strategies.deepspeed.strategy import DeepSpeedStrategy

__all__ = [
    "consolidate_deepspeed_checkpoint",
    "load_engine",
    "load_engine_optimizer",
    "load_native",
    "refuse_plain_optimizer_state",
    "save_checkpoint",
]


def save_checkpoint(strategy: DeepSpeedStrategy, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` as a DeepSpeed checkpoint directory at ``path`` (every rank writes
    its shard). The engine carries the model and its optimizer; the other entries travel
    as DeepSpeed's client state (modules that are not the engine as state dicts)."""
    engine, optimizer = _engine_and_optimizer(strategy, state, "lite.save")
    entries: dict[str, Any] = {}
    for key, value in state.items():
        if value is engine or value is optimizer:
            continue
        if isinstance(value, torch.optim.Optimizer) and strategy.model_of(value) is not None:
            raise ValueError(
                f"lite.save: state[{key!r}] is the optimizer of another model; "
                "strategy='deepspeed' saves one engine per checkpoint."
            )
        entries[key] = value.state_dict() if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) else value
    keys = {id(v): k for k, v in state.items()}
    client = client_state(list(state), kinds_of(state), keys[id(engine)], keys.get(id(optimizer)), entries)
    target = Path(path).absolute()
    # Written under a temporary name and renamed into place once every rank has finished,
    # so a crash leaves the previous checkpoint or the new one, never a mix of both.
    token = strategy.broadcast(secrets.token_hex(4) if strategy.placement.is_global_zero else None, src=0)
    partial = target.parent / f".{target.name}.{token}.tmp"
    with filtered_warnings():
        engine.save_checkpoint(str(partial), tag=TAG, client_state={CLIENT_KEY: client})
    strategy.barrier()
    if strategy.placement.is_global_zero:
        swap_folder_into_place(partial, target, token)
    strategy.barrier()


def load_native(strategy: DeepSpeedStrategy, checkpoint: Checkpoint, state: dict[str, Any], strict: bool) -> list[str]:
    """Load the engine (and its optimizer, if ``state`` holds it) with ``engine.load_checkpoint``
    when ``checkpoint`` is DeepSpeed's own at this world size and stage. Returns the keys of
    ``state`` it restored (none: the checkpoint is converted instead)."""
    same = (
        isinstance(checkpoint, DeepSpeedFolder)
        and checkpoint.world_size == strategy.placement.world_size
        and checkpoint.stage == strategy.stage
    )
    engines = [v for v in state.values() if isinstance(v, strategy.deepspeed.DeepSpeedEngine)]
    if not same or len(engines) != 1:
        return []
    engine, optimizer = _engine_and_optimizer(strategy, state, "lite.load")
    with filtered_warnings():
        loaded, _ = engine.load_checkpoint(
            str(checkpoint.path),
            tag=TAG,
            load_module_strict=strict,
            load_optimizer_states=optimizer is not None,
            load_lr_scheduler_states=False,
        )
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {checkpoint.path}.")
    return [key for key, value in state.items() if value is engine or (optimizer is not None and value is optimizer)]


def _engine_and_optimizer(strategy: DeepSpeedStrategy, state: dict[str, Any], caller: str) -> tuple[Any, Any]:
    engines = [v for v in state.values() if isinstance(v, strategy.deepspeed.DeepSpeedEngine)]
    if len(engines) != 1:
        raise ValueError(
            f"{caller} under strategy='deepspeed' needs exactly one model returned by "
            f"lite.setup in the state dict (the engine carries model and optimizer), got "
            f"{len(engines)}."
        )
    engine = engines[0]
    optimizer = strategy.optimizer_of(engine)
    return engine, optimizer if any(v is optimizer for v in state.values()) else None


# -- converting any checkpoint into an engine --------------------------------------------------


def _zero_optimizer(engine: Any, user: torch.optim.Optimizer | None) -> Any:
    """The engine's ZeRO optimizer (stages 1-3), or None where the engine keeps no fp32
    partitions: stage 0 with a plain torch optimizer, a ZeRO-3 model set up without one.
    ``user``: the torch optimizer the model was set up with."""
    optimizer = engine.optimizer
    stage = engine.zero_optimization_stage()
    if stage == 0 and optimizer is not None and optimizer is not user:
        raise CheckpointError(
            f"lite.load cannot convert a checkpoint into this DeepSpeed engine (ZeRO stage 0 "
            f"with {type(optimizer).__name__}): it keeps fp32 copies in a layout scopedlite does "
            "not write. Use ZeRO stage 1, 2 or 3, or load a DeepSpeed checkpoint written at "
            "this world size and stage."
        )
    return None if stage == 0 or user is None else optimizer


def load_engine(engine: Any, user: torch.optim.Optimizer | None, tensors: Tensors, strict: bool) -> None:
    """Load a module entry of any checkpoint into a DeepSpeed engine (set up with the torch
    optimizer ``user``, if any): its parameters' parts this rank holds (ZeRO-3: its partition;
    else: whole), their fp32 master copies, buffers."""
    inner = engine.module
    zero = _zero_optimizer(engine, user)
    if zero is None and engine.zero_optimization_stage() < 3:
        load_module(inner, tensors, strict)  # stage 0, plain torch optimizer: nothing sharded
        return
    keys = check_keys(list(inner.state_dict(keep_vars=True)), tensors, strict, type(inner).__name__)
    params, buffers = dict(inner.named_parameters()), dict(inner.named_buffers())
    slots = {id(s.param): s for s in zero_slots(zero)} if zero is not None else {}
    stage3 = engine.zero_optimization_stage() == 3
    with torch.no_grad():
        for key in keys:
            if key in buffers:
                buffers[key].copy_(tensors.read(key))
            elif key in params:
                param = params[key]
                check_shape(key, tensors.info[key], full_shape(param))
                slot = slots.get(id(param))
                if stage3:
                    start, numel, _ = zero3_partition(param)
                    part = read_flat(tensors, key, start, start + numel)
                    write_zero3_partition(param, part, lambda k=key: tensors.read(k))
                else:
                    whole = tensors.read(key)
                    param.copy_(whole.view(param.shape))
                    part = whole.reshape(-1)[slot.start : slot.start + slot.numel] if slot else None
                if slot is not None and slot.numel:
                    slot.flat[slot.offset : slot.offset + slot.numel].copy_(part)
            elif key in tensors.extras:
                raise CheckpointError(
                    f"{type(inner).__name__}.{key} is extra state (get_extra_state), which a "
                    "DeepSpeed engine cannot load from a checkpoint; load it before lite.setup."
                )


def load_engine_optimizer(engine: Any, optimizer: torch.optim.Optimizer, entry: OptimizerEntry) -> None:
    """Load an optimizer entry of any checkpoint into the optimizer DeepSpeed steps: hyper-
    parameters per group, and each flat fp32 partition's state from its parameters' parts
    (one step count per partition: the parameters in it must agree)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    zero = _zero_optimizer(engine, optimizer)
    if zero is None:  # stage 0 with the user's torch optimizer: it holds the model's parameters
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        load_optimizer(optimizer, entry, groups)
        return
    slots = zero_slots(zero)
    groups = [[] for _ in optimizer.param_groups]
    for slot in slots:
        groups[slot.group].append(names[id(slot.param)])
    entry = entry.by_name([n for group in groups for n in group])
    entry.check_groups(groups)
    for index, group in enumerate(optimizer.param_groups):
        group.update(entry.hyperparameters(index))
    partitions: dict[int, list[ZeroSlot]] = {}
    for slot in slots:
        partitions.setdefault(id(slot.flat), []).append(slot)
    for members in partitions.values():
        _load_partition(optimizer, entry, [(names[id(s.param)], s) for s in members])


def _load_partition(
    optimizer: torch.optim.Optimizer, entry: OptimizerEntry, members: Sequence[tuple[str, ZeroSlot]]
) -> None:
    flat = members[0][1].flat
    stated = [name for name, _ in members if entry.state.get(name)]
    if not stated:
        return  # never stepped: the optimizer creates its state at the first step
    if len(stated) != len(members):
        unstated = [name for name, _ in members if name not in stated]
        raise CheckpointError(
            f"DeepSpeed keeps one optimizer state for parameters {[n for n, _ in members][:5]}..., "
            f"but the checkpoint has state for some of them only (none for {unstated[:5]}): "
            "this optimizer state cannot be loaded under strategy='deepspeed'."
        )
    first = entry.state[stated[0]]
    current = optimizer.state.get(flat, {})
    new: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, TensorInfo):
            buffer = current.get(key)
            if not (isinstance(buffer, torch.Tensor) and buffer.shape == flat.shape):
                buffer = torch.zeros_like(flat, dtype=value.dtype)
            for name, slot in members:
                if slot.numel:
                    part = read_flat(entry.tensors, (name, key), slot.start, slot.start + slot.numel)
                    buffer[slot.offset : slot.offset + slot.numel].copy_(part)
            new[key] = buffer
        else:
            others = [entry.state[name].get(key) for name in stated]
            if not all(_same(value, other) for other in others):
                raise CheckpointError(
                    f"DeepSpeed keeps one {key!r} for parameters {stated[:5]}..., and the checkpoint's "
                    f"values differ between them ({[_plain(o) for o in others][:5]}): this optimizer "
                    "state cannot be loaded under strategy='deepspeed' without changing it."
                )
            new[key] = value.clone() if isinstance(value, torch.Tensor) else value
    optimizer.state[flat] = new


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return bool(a == b)


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def refuse_plain_optimizer_state(stage: int) -> Any:
    """A ``load_state_dict`` pre-hook for the user's optimizer under DeepSpeed: a state dict
    whose parameter groups do not hold as many parameters as the optimizer's (a plain torch
    optimizer's, loaded on every rank to resume) is refused, naming the way that converts it.
    At ZeRO stages 1-3 the engine gives the optimizer its flat partitions (one tensor per
    group) in place of the model's parameters, and torch refused the load with "loaded state
    dict contains a parameter group that doesn't match the size of optimizer's group", which
    names neither the cause nor the fix."""

    def hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        saved = [len(group["params"]) for group in state_dict.get("param_groups", [])]
        held = [len(group["params"]) for group in optimizer.param_groups]
        if saved != held:
            raise ValueError(
                f"optimizer.load_state_dict() got the state of an optimizer over {sum(saved)} "
                f"parameter(s) (groups {saved}), but under strategy='deepspeed' (ZeRO stage {stage}) "
                f"the engine holds this optimizer's state in its own flat partitions (its groups "
                f"now hold {held} tensor(s)): a plain torch "
                "optimizer's state cannot be loaded into it as it is. Use "
                '`lite.load(path, {"model": model, "opt": opt})`, which converts a plain torch '
                "checkpoint (a dict of the model's and the optimizer's state dicts) into each "
                "rank's partitions, or a checkpoint lite.save wrote."
            )

    return hook


def consolidate_deepspeed_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """One fp32 state dict of the model from a checkpoint ``lite.save`` wrote under DeepSpeed.

    Runs in one process, outside any launch (it reads the shards from disk, DeepSpeed need
    not be installed), and returns a state dict that loads into the plain model:
    ``model.load_state_dict(state)``. For the whole checkpoint in one file (optimizer and
    other entries too), use ``lite.consolidate_checkpoint(path, file)``.
    """
    directory = Path(path)
    if not (directory / TAG).is_dir():
        raise FileNotFoundError(
            f"{path} is not a DeepSpeed checkpoint written by lite.save under strategy='deepspeed' "
            f"(no {TAG}/ folder inside)."
        )
    with contextlib.closing(DeepSpeedFolder(directory, weights_only=True)) as checkpoint:
        tensors = checkpoint.engine_module()
        return {**dict(zip(tensors.info, tensors.read_many([(k, None) for k in tensors.info]))), **tensors.extras}
