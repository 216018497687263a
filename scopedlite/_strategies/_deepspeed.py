"""DeepSpeed ZeRO (stages 1-3, optional CPU offload) behind the same short strategy interface.

Our launcher starts the processes and creates the process group; DeepSpeed is handed that
group (``deepspeed.init_distributed`` finds it and builds nothing of its own), so collectives,
failures and the end of the run work exactly as under DDP. What is DeepSpeed's own:

- ``lite.setup(model, opt)`` calls ``deepspeed.initialize``; the engine is the model it
  returns. The optimizer it returns is the user's own torch optimizer, whose ``step`` goes
  through ``engine.step()`` (the engine reduces, clips, steps and zeroes gradients).
- ``lite.sharded_init()`` under ZeRO-3 is ``deepspeed.zero.Init``: parameters are partitioned
  as they are created, so no rank ever holds the whole model.
- ``lite.save``/``lite.load`` write and read the engine's sharded checkpoint directory.

DeepSpeed is imported when the strategy starts, never at ``import scopedlite``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import secrets
import shutil
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Mapping

import torch

from scopedlite import _distributed
from scopedlite._strategies._process_group import ProcessGroupCollectives
from scopedlite._strategies._reroute import reroute_step
from scopedlite._strategies._base import Rendezvous, Strategy

if TYPE_CHECKING:
    from scopedlite._run import Run

__all__ = ["DeepSpeedStrategy", "consolidate_deepspeed_checkpoint"]

STAGES = (0, 1, 2, 3)
_INSTALL_HINT = "pip install scopedlite[deepspeed]"
# Precision names -> the DeepSpeed config section that enables it (None: full fp32).
_PRECISION_SECTIONS: dict[str, str | None] = {
    "32-true": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}
_HALF_SECTIONS = ("fp16", "bf16")
# The variables DeepSpeed reads from the environment (LOCAL_RANK is required by its engine and
# by zero.Init). Our workers have them already; rank 0 of our launcher and forked workers do
# not, so the strategy sets them in its own process for the run and restores them in stop().
_WORLD_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def import_deepspeed() -> Any:
    """Import DeepSpeed, or explain how to install it."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            f"strategy='deepspeed' needs the DeepSpeed package, which is not installed: "
            f"{_INSTALL_HINT} (or pip install deepspeed). Import failed with: {e}"
        ) from e
    return deepspeed


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def _read_config(config: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeedStrategy(config={str(config)!r}): no such JSON file.")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeedStrategy(config={str(config)!r}) is not valid JSON: {e}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"DeepSpeedStrategy(config={str(config)!r}) must hold a JSON object.")
        return loaded
    raise TypeError(
        f"DeepSpeedStrategy(config=...) takes a dict or the path of a JSON file, got "
        f"{type(config).__name__} ({config!r})."
    )


class DeepSpeedStrategy(ProcessGroupCollectives, Strategy):
    """DeepSpeed ZeRO data parallelism over one process per device.

    Args:
        stage: ZeRO stage: 0 (plain data parallel), 1 (optimizer states sharded),
            2 (+ gradients), 3 (+ parameters). None takes it from ``config``, else 2.
        config: A DeepSpeed config, as a dict or the path of a JSON file. Anything the other
            arguments or ``launch(precision=...)`` also set must agree with them; a
            contradiction raises ``ValueError`` before the run starts. Gradient accumulation
            (``gradient_accumulation_steps``) and clipping (``gradient_clipping``) are set
            here: the engine applies them.
        offload_optimizer: Keep optimizer states in CPU memory (ZeRO-Offload, stages 1-3).
            None: as the config says, else off.
        offload_parameters: Keep parameters in CPU memory (ZeRO-Infinity, stage 3 only).
            None: as the config says, else off.
        process_group_backend: ``"gloo"`` or ``"nccl"``; None picks NCCL on CUDA, else gloo.

    Defaults added where the config is silent: ``train_micro_batch_size_per_gpu=1`` (DeepSpeed
    insists on a batch size, which only matters for its throughput logs),
    ``gradient_clipping=0.0`` (recent DeepSpeed clips to 1.0 by default, which would silently
    change the training the same loop does under DDP), ``zero_allow_untested_optimizer=True``
    and ``zero_force_ds_cpu_optimizer=False``, so the torch optimizer passed to ``lite.setup``
    is used as is.
    """

    name: ClassVar[str] = "deepspeed"
    accelerators: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def __init__(
        self,
        stage: int | None = None,
        config: dict[str, Any] | str | os.PathLike[str] | None = None,
        offload_optimizer: bool | None = None,
        offload_parameters: bool | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        if stage is not None and (isinstance(stage, bool) or stage not in STAGES):
            raise ValueError(f"stage={stage!r} is not a ZeRO stage. Valid choices: {STAGES} or None.")
        for arg, value in (("offload_optimizer", offload_optimizer), ("offload_parameters", offload_parameters)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{arg} must be True, False or None, got {value!r}.")
        if process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is not valid; choose "
                "'gloo', 'nccl' or None."
            )
        self.user_config = _read_config(config)
        zero = self.user_config.get("zero_optimization", {})
        if not isinstance(zero, Mapping):
            raise ValueError(f"config['zero_optimization'] must be a dict, got {zero!r}.")
        config_stage = zero.get("stage")
        if stage is not None and config_stage is not None and config_stage != stage:
            raise ValueError(
                f"DeepSpeedStrategy(stage={stage}) contradicts config['zero_optimization']"
                f"['stage']={config_stage!r}. Set the stage in one place."
            )
        resolved = stage if stage is not None else (config_stage if config_stage is not None else 2)
        if resolved not in STAGES:
            raise ValueError(
                f"config['zero_optimization']['stage']={resolved!r} is not a ZeRO stage. Valid "
                f"choices: {STAGES}."
            )
        self.stage: int = resolved
        self.offload_optimizer = self._offload("offload_optimizer", offload_optimizer, zero)
        self.offload_parameters = self._offload("offload_param", offload_parameters, zero)
        if self.offload_parameters and self.stage != 3:
            raise ValueError(
                f"offload_parameters=True needs ZeRO stage 3 (parameters are only partitioned "
                f"there), but stage={self.stage}. Use stage=3 or strategy='deepspeed_stage_3_offload'."
            )
        if self.offload_optimizer and self.stage == 0:
            raise ValueError("offload_optimizer=True needs ZeRO stage 1, 2 or 3, not stage=0.")
        self.process_group_backend = process_group_backend

    def _offload(self, key: str, requested: bool | None, zero: Mapping[str, Any]) -> bool:
        argument = "offload_parameters" if key == "offload_param" else key
        section = zero.get(key)
        device = section.get("device", "none") if isinstance(section, Mapping) else None
        configured = None if device is None else device != "none"
        if requested is not None and configured is not None and requested != configured:
            raise ValueError(
                f"DeepSpeedStrategy({argument}={requested}) contradicts config"
                f"['zero_optimization']['{key}']={dict(section)!r}. Set it in one place."  # type: ignore[arg-type]
            )
        return bool(requested if requested is not None else configured)

    def fresh(self) -> DeepSpeedStrategy:
        fresh = super().fresh()
        assert isinstance(fresh, DeepSpeedStrategy)
        fresh.user_config = copy.deepcopy(self.user_config)
        return fresh

    def describe(self) -> str:
        return (
            f"DeepSpeedStrategy(stage={self.stage}, offload_optimizer={self.offload_optimizer}, "
            f"offload_parameters={self.offload_parameters})"
        )

    def backend(self, accelerator: str) -> str:
        return self.process_group_backend or super().backend(accelerator)

    # -- configuration ------------------------------------------------------------------
    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        if self.process_group_backend == "nccl" and accelerator != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs accelerator='cuda', not {accelerator!r}; "
                "use 'gloo' (or None) on CPU."
            )
        self.build_config(precision, accelerator)
        if importlib.util.find_spec("deepspeed") is None:  # refuse before any process starts
            import_deepspeed()

    def build_config(self, precision: str, accelerator: str) -> dict[str, Any]:
        """The config handed to DeepSpeed: the user's, completed by the arguments.

        Raises ``ValueError`` where the config and the arguments disagree.
        """
        if precision not in _PRECISION_SECTIONS:
            raise ValueError(
                f"precision={precision!r} is not supported by DeepSpeed. Valid choices under "
                f"strategy='deepspeed': {', '.join(repr(p) for p in _PRECISION_SECTIONS)}."
            )
        wanted = _PRECISION_SECTIONS[precision]
        if wanted == "fp16" and accelerator == "cpu":
            raise ValueError(
                f"precision={precision!r} under strategy='deepspeed' on accelerator='cpu': "
                "DeepSpeed's fp16 loss scaling is not supported on CPU. Use precision='bf16-mixed'."
            )
        config = copy.deepcopy(self.user_config)
        for section in _HALF_SECTIONS:
            if _enabled(config.get(section)) and section != wanted:
                raise ValueError(
                    f"DeepSpeed config enables {section!r} but launch(precision={precision!r}) "
                    f"asks for {'full fp32' if wanted is None else repr(wanted)}. Set the precision in "
                    f"one place: pass precision="
                    f"{'bf16-mixed' if section == 'bf16' else '16-mixed'!r} to launch, or remove "
                    f"config[{section!r}]."
                )
        if wanted is not None:
            section = config.get(wanted)
            section = dict(section) if isinstance(section, Mapping) else {}
            section["enabled"] = True
            config[wanted] = section
        zero = dict(config.get("zero_optimization", {}))
        zero["stage"] = self.stage
        if self.offload_optimizer:
            zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
        if self.offload_parameters:
            zero["offload_param"] = {**zero.get("offload_param", {}), "device": "cpu"}
        config["zero_optimization"] = zero
        if not any(k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
            config["train_micro_batch_size_per_gpu"] = 1
        # DeepSpeed >= 0.18 clips gradients to norm 1.0 unless told otherwise: a silent change
        # to the user's training. Clipping happens when the config asks for it, not by default.
        config.setdefault("gradient_clipping", 0.0)
        config.setdefault("zero_allow_untested_optimizer", True)
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        return config

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The dtype DeepSpeed keeps the model in (None: fp32)."""
        if _enabled(self.config.get("bf16")):
            return torch.bfloat16
        if _enabled(self.config.get("fp16")):
            return torch.float16
        return None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, run: Run, rendezvous: Rendezvous | None) -> None:
        assert rendezvous is not None, "DeepSpeed needs a rendezvous"
        try:
            self._start(run, rendezvous)
        except BaseException:
            self.stop()  # leave no process group or environment variable behind
            raise

    def _start(self, run: Run, rendezvous: Rendezvous) -> None:
        self.run = run
        self.config = self.build_config(run.precision.name, run.accelerator)
        self._backend = self.backend(run.accelerator)
        self._comm_device = _distributed.comm_device(self._backend, run.device)
        self._engines: list[Any] = []
        self._saved_env: dict[str, str | None] = {}
        world = rendezvous.world
        self._set_env({
            "RANK": str(world.global_rank),
            "LOCAL_RANK": str(world.local_rank),
            "WORLD_SIZE": str(world.world_size),
            "LOCAL_WORLD_SIZE": str(world.local_world_size),
            "MASTER_ADDR": world.main_address,
            "MASTER_PORT": str(world.main_port),
        })
        if run.accelerator == "cpu" and "DS_ACCELERATOR" not in os.environ:
            self._set_env({"DS_ACCELERATOR": "cpu"})  # else DeepSpeed warns while detecting
        if run.accelerator == "cuda":
            torch.cuda.set_device(run.device)
        _distributed.init_process_group(
            self._backend, world, timeout=run.timeout, store=rendezvous.store, device=run.device
        )
        self._owns_group = True
        before = dict(os.environ)
        self.deepspeed = import_deepspeed()
        # Importing DeepSpeed sets PYTORCH_NVML_BASED_CUDA_CHECK for good; the run ends with
        # the environment it started with.
        for key in set(os.environ) - set(before):
            self._saved_env.setdefault(key, None)
        self._log_level = _quiet_deepspeed()
        # DeepSpeed finds our process group and wraps it; it creates none of its own. Its
        # first call builds a small C++ op with gcc (cached in TORCH_EXTENSIONS_DIR) and prints
        # that it did on every rank: that print (main thread, Python-level) is dropped.
        with contextlib.redirect_stdout(_Discard()):
            self.deepspeed.init_distributed(dist_backend=self._backend, timeout=run.timeout)

    def _set_env(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            if os.environ.get(key) == value:
                continue
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def stop(self) -> None:
        for engine in getattr(self, "_engines", ()):
            if hasattr(engine, "destroy"):  # releases the engine's hooks and buffers
                engine.destroy()
        self._engines = []
        if getattr(self, "_owns_group", False):
            _distributed.destroy_process_group()
            self._owns_group = False
        for key, value in getattr(self, "_saved_env", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        if getattr(self, "_log_level", None) is not None:
            from deepspeed.utils import logger

            logger.setLevel(self._log_level)
            self._log_level = None

    # -- modules and optimizers ---------------------------------------------------------
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """A model set up without an optimizer: an engine for evaluation only."""
        engine, _ = self.setup_module_and_optimizers(module, ())
        return engine

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise RuntimeError(
            "Under strategy='deepspeed' the model and its optimizer are set up together, "
            "because deepspeed.initialize builds the engine from both: "
            "`model, opt = lite.setup(model, opt)`."
        )

    def setup_module_and_optimizers(
        self, module: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
        """``deepspeed.initialize`` on the model and (at most one) optimizer."""
        if isinstance(module, self.deepspeed.DeepSpeedEngine):
            raise TypeError(
                "lite.setup got a DeepSpeed engine; pass the plain module (`lite.setup(model, "
                "opt)`) and scopedlite builds the engine."
            )
        if len(optimizers) > 1:
            raise ValueError(
                f"strategy='deepspeed' drives one optimizer per model, got {len(optimizers)}. "
                "Put the parameter groups in one optimizer."
            )
        optimizer = optimizers[0] if optimizers else None
        with _filtered_warnings():
            engine, _, _, _ = self.deepspeed.initialize(
                model=module.to(self.run.device) if not _is_zero3_built(module) else module,
                optimizer=optimizer,
                config=copy.deepcopy(self.config),
                dist_init_required=False,
            )
        self._engines.append(engine)
        forward = engine.forward

        def quiet_forward(*args: Any, **kwargs: Any) -> Any:
            with _filtered_warnings():  # ZeRO-3 gathers parameters inside forward
                return forward(*args, **kwargs)

        engine.forward = quiet_forward
        if self.half_dtype is not None:
            engine.register_forward_pre_hook(_input_caster(self.half_dtype), with_kwargs=True)
        if optimizer is None:
            return engine, []
        _route_step_through_engine(optimizer, engine)
        return engine, [optimizer]

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, self.deepspeed.DeepSpeedEngine) else module

    def module_init_context(self, empty: bool) -> ContextManager[Any]:
        if self.stage != 3:
            return super().module_init_context(empty)
        from scopedlite._init import skip_init

        stack = contextlib.ExitStack()
        stack.enter_context(_filtered_warnings())
        stack.enter_context(
            self.deepspeed.zero.Init(
                config_dict_or_path=copy.deepcopy(self.config),
                remote_device="cpu" if self.offload_parameters else None,
                dtype=self.half_dtype or torch.float32,
            )
        )
        if empty:
            stack.enter_context(skip_init())
        return stack

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        engine = self._engine_of(None)
        if args or kwargs:
            raise TypeError(
                "lite.backward(loss) under strategy='deepspeed' takes the loss only (it calls "
                f"engine.backward(loss)); got extra arguments {args!r} {kwargs!r}."
            )
        with _filtered_warnings():
            engine.backward(loss)

    def clip_gradients(self, module, optimizer, max_norm, clip_val):  # type: ignore[no-untyped-def]
        raise RuntimeError(
            "lite.clip_gradients is not available under strategy='deepspeed': the engine clips "
            "inside optimizer.step(), by total norm, from its config. Remove the call and "
            "pass lite.DeepSpeedStrategy(config={'gradient_clipping': "
            f"{max_norm if max_norm is not None else 1.0}}}) to launch instead."
        )

    def _engine_of(self, module: Any) -> Any:
        if module is not None:
            return module
        # lite.backward(loss) names no model: it is the one engine that trains (has an
        # optimizer); engines set up without one are for evaluation.
        training = [e for e in self._engines if getattr(e, "_lite_user_optimizer", None) is not None]
        if len(training) != 1:
            raise RuntimeError(
                "lite.backward under strategy='deepspeed' needs exactly one model set up with "
                f"its optimizer (`model, opt = lite.setup(model, opt)`); this run has {len(training)}."
            )
        return training[0]

    # -- checkpoints: the engine's sharded directory ------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        """Write ``state`` as a DeepSpeed checkpoint directory at ``path`` (every rank writes
        its shard). The engine carries the model and its optimizer; the other entries travel
        as DeepSpeed's client state (modules that are not the engine as state dicts)."""
        engine, client = self._split_state(state, "lite.save")
        target = Path(path).absolute()
        # Written under a temporary name and renamed into place once every rank has finished,
        # so a crash leaves the previous checkpoint or the new one, never a mix of both.
        token = self.broadcast(secrets.token_hex(4) if self.run.is_global_zero else None, src=0)
        partial = target.parent / f".{target.name}.{token}.tmp"
        with _filtered_warnings():
            engine.save_checkpoint(str(partial), tag=_TAG, client_state={_CLIENT_KEY: client})
        self.barrier()
        if self.run.is_global_zero:
            old = target.parent / f".{target.name}.{token}.old"
            if target.exists():
                target.rename(old)
            partial.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any], strict: bool) -> dict[str, Any]:
        """Restore the engine (and its optimizer, if ``state`` holds it) from ``path`` and the
        other entries of ``state`` from the client state. Returns what else was saved."""
        directory = Path(path)
        if not (directory / _TAG).is_dir():
            raise FileNotFoundError(
                f"{path} is not a DeepSpeed checkpoint written by lite.save under "
                f"strategy='deepspeed' (no {_TAG}/ folder inside). To start from a full state "
                "dict, load it into the model before lite.setup."
            )
        engine, wanted = self._split_state(state, "lite.load")
        user_optimizer = getattr(engine, "_lite_user_optimizer", None)
        load_optimizer = user_optimizer is not None and any(v is user_optimizer for v in state.values())
        with _filtered_warnings():
            loaded, client = engine.load_checkpoint(
                str(path),
                tag=_TAG,
                load_module_strict=strict,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=False,
            )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint at {path}.")
        client = client.get(_CLIENT_KEY, {})
        missing = [k for k in wanted if k not in client]
        if missing and strict:
            raise KeyError(
                f"{path} has no entry {missing}; it holds {sorted(client)}. Pass strict=False to "
                "restore only what is there."
            )
        for key, value in state.items():
            if key not in client:
                continue
            if isinstance(value, torch.nn.Module):
                value.load_state_dict(client[key], strict=strict)
            elif isinstance(value, torch.optim.Optimizer):
                value.load_state_dict(client[key])
            else:
                state[key] = client[key]
        return {k: v for k, v in client.items() if k not in state}

    def _split_state(self, state: dict[str, Any], caller: str) -> tuple[Any, dict[str, Any]]:
        engines = [v for v in state.values() if isinstance(v, self.deepspeed.DeepSpeedEngine)]
        if len(engines) != 1:
            raise ValueError(
                f"{caller} under strategy='deepspeed' needs exactly one model returned by "
                f"lite.setup in the state dict (the engine carries model and optimizer), got "
                f"{len(engines)}."
            )
        engine = engines[0]
        client: dict[str, Any] = {}
        for key, value in state.items():
            if value is engine or value is getattr(engine, "_lite_user_optimizer", None):
                continue
            if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
                if isinstance(value, torch.optim.Optimizer) and getattr(value, "_lite_engine", None) is not None:
                    raise ValueError(
                        f"{caller}: state[{key!r}] is the optimizer of another model; "
                        "strategy='deepspeed' saves one engine per checkpoint."
                    )
                client[key] = value.state_dict()
            else:
                client[key] = value
        return engine, client


# The tag (sub-folder) the engine writes; fixed so a checkpoint is one self-contained folder.
_TAG = "checkpoint"
# The key of DeepSpeed's client state under which our entries travel, apart from the keys
# DeepSpeed adds to the same dict.
_CLIENT_KEY = "scopedlite"


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
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # It logs and prints its progress (and progress bars on stderr); errors still raise.
    from deepspeed.utils import logger

    level = _quiet_deepspeed()
    try:
        with contextlib.redirect_stdout(_Discard()), contextlib.redirect_stderr(_Discard()):
            state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=_TAG)
    finally:
        logger.setLevel(level)
    return dict(state)


def _route_step_through_engine(optimizer: torch.optim.Optimizer, engine: Any) -> None:
    """Make ``optimizer.step()`` run ``engine.step()`` and ``zero_grad()`` leave the gradients
    to the engine; the engine's own calls into the optimizer reach the real methods.

    Rerouted on the instance (see _reroute.py), so the optimizer keeps its class and LR
    schedulers built on it keep working.
    """
    original_zero_grad = optimizer.zero_grad

    def engine_step() -> None:
        with _filtered_warnings():
            engine.step()

    inside_engine = reroute_step(
        optimizer,
        engine_step,
        "optimizer.step(closure) cannot be used under strategy='deepspeed': the engine steps "
        "after lite.backward(loss). Call optimizer.step() without a closure.",
    )

    def zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        # The engine zeroes its (partitioned) gradients itself after each step it takes; with
        # gradient accumulation a user's zero_grad between micro-batches must not erase them.
        if inside_engine():
            original_zero_grad(set_to_none=set_to_none)

    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
    optimizer._lite_engine = engine  # type: ignore[attr-defined]
    engine._lite_user_optimizer = optimizer


def _is_zero3_built(module: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _input_caster(dtype: torch.dtype) -> Any:
    """A forward pre-hook casting floating inputs to the dtype DeepSpeed holds the model in
    (its bf16/fp16 modes convert the whole model, unlike torch autocast)."""
    from scopedlite._structures import map_tensors

    def cast(_: Any, args: Any, kwargs: Any) -> Any:
        convert = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
        return map_tensors(args, convert), map_tensors(kwargs, convert)

    return cast


class _Discard:
    """A stdout that drops DeepSpeed's unconditional prints (e.g. "op built successfully")."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        return None


def _quiet_deepspeed() -> int:
    """Keep DeepSpeed's INFO logging (config dumps, timers, per-step reports) out of the way;
    warnings and errors still show. Returns the level it had."""
    from deepspeed.utils import logger

    previous = logger.level
    logger.setLevel(max(previous, logging.WARNING))
    return previous


@contextlib.contextmanager
def _filtered_warnings() -> Any:
    """Hide torch deprecation warnings ZeRO-3 triggers on every step (its use of
    ``torch.distributed._all_gather_base``-era APIs and tensor storage); they are DeepSpeed's
    to fix and say nothing to the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"deepspeed\..*")
        yield
