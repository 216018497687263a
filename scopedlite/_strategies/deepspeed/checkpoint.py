"""DeepSpeed checkpoints: the engine's own sharded directory, written atomically.

``lite.save`` under DeepSpeed writes the engine's checkpoint (every rank its shard) under a
temporary name and renames it into place once every rank is done; the entries of the state
that are not the engine travel as DeepSpeed's client state. ``consolidate_deepspeed_checkpoint``
makes one fp32 state dict of it in a single process.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scopedlite._io.files import restore, swap_folder_into_place
from scopedlite._strategies.deepspeed.install import import_deepspeed
from scopedlite._strategies.deepspeed.logs import (
    Discard,
    filtered_warnings,
    quiet_deepspeed,
)

if TYPE_CHECKING:
    from scopedlite._strategies.deepspeed.strategy import DeepSpeedStrategy

__all__ = ["consolidate_deepspeed_checkpoint", "load_checkpoint", "save_checkpoint"]

# The tag (sub-folder) the engine writes; fixed so a checkpoint is one self-contained folder.
_TAG = "checkpoint"
# The key of DeepSpeed's client state under which our entries travel, apart from the keys
# DeepSpeed adds to the same dict.
_CLIENT_KEY = "scopedlite"


def save_checkpoint(strategy: DeepSpeedStrategy, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` as a DeepSpeed checkpoint directory at ``path`` (every rank writes
    its shard). The engine carries the model and its optimizer; the other entries travel
    as DeepSpeed's client state (modules that are not the engine as state dicts)."""
    engine, client = _split_state(strategy, state, "lite.save")
    target = Path(path).absolute()
    # Written under a temporary name and renamed into place once every rank has finished,
    # so a crash leaves the previous checkpoint or the new one, never a mix of both.
    token = strategy.broadcast(secrets.token_hex(4) if strategy.placement.is_global_zero else None, src=0)
    partial = target.parent / f".{target.name}.{token}.tmp"
    with filtered_warnings():
        engine.save_checkpoint(str(partial), tag=_TAG, client_state={_CLIENT_KEY: client})
    strategy.barrier()
    if strategy.placement.is_global_zero:
        swap_folder_into_place(partial, target, token)
    strategy.barrier()


def load_checkpoint(strategy: DeepSpeedStrategy, path: str | os.PathLike[str], state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Restore the engine (and its optimizer, if ``state`` holds it) from ``path`` and the
    other entries of ``state`` from the client state. Returns what else was saved."""
    directory = Path(path)
    if not (directory / _TAG).is_dir():
        raise FileNotFoundError(
            f"{path} is not a DeepSpeed checkpoint written by lite.save under "
            f"strategy='deepspeed' (no {_TAG}/ folder inside). To start from a full state "
            "dict, load it into the model before lite.setup."
        )
    engine, wanted = _split_state(strategy, state, "lite.load")
    user_optimizer = strategy.optimizer_of(engine)
    load_optimizer = user_optimizer is not None and any(v is user_optimizer for v in state.values())
    with filtered_warnings():
        loaded, client = engine.load_checkpoint(
            str(path),
            tag=_TAG,
            load_module_strict=strict,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=False,
        )
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {path}.")
    # The other entries travelled as client state: restored like a single-file checkpoint.
    rest = {key: state[key] for key in wanted}
    others = restore(strategy, path, client.get(_CLIENT_KEY, {}), rest, strict)
    state.update(rest)
    return others


def _split_state(strategy: DeepSpeedStrategy, state: dict[str, Any], caller: str) -> tuple[Any, dict[str, Any]]:
    engines = [v for v in state.values() if isinstance(v, strategy.deepspeed.DeepSpeedEngine)]
    if len(engines) != 1:
        raise ValueError(
            f"{caller} under strategy='deepspeed' needs exactly one model returned by "
            f"lite.setup in the state dict (the engine carries model and optimizer), got "
            f"{len(engines)}."
        )
    engine = engines[0]
    client: dict[str, Any] = {}
    for key, value in state.items():
        if value is engine or value is strategy.optimizer_of(engine):
            continue
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            if isinstance(value, torch.optim.Optimizer) and strategy.model_of(value) is not None:
                raise ValueError(
                    f"{caller}: state[{key!r}] is the optimizer of another model; "
                    "strategy='deepspeed' saves one engine per checkpoint."
                )
            client[key] = value.state_dict()
        else:
            client[key] = value
    return engine, client


def consolidate_deepspeed_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """One fp32 state dict of the model from a checkpoint ``lite.save`` wrote under DeepSpeed.

    Runs in one process, outside any launch (it reads the shards from disk), and returns a
    state dict that loads into the plain model: ``model.load_state_dict(state)``.
    """
    directory = Path(path)
    if not (directory / _TAG).is_dir():
        raise FileNotFoundError(
            f"{path} is not a DeepSpeed checkpoint written by lite.save under strategy='deepspeed' "
            f"(no {_TAG}/ folder inside)."
        )
    import_deepspeed()
    from deepspeed.utils import logger
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # It logs and prints its progress (and progress bars on stderr); errors still raise.
    level = quiet_deepspeed()
    try:
        with contextlib.redirect_stdout(Discard()), contextlib.redirect_stderr(Discard()):
            state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=_TAG)
    finally:
        logger.setLevel(level)
    return dict(state)
