"""DeepSpeed ZeRO (stages 1-3, optional CPU offload) behind the same short strategy interface.

Our launcher starts the processes and creates the process group; DeepSpeed is handed that
group (``deepspeed.init_distributed`` finds it and builds nothing of its own), so collectives,
failures and the end of the run work exactly as under DDP. What is DeepSpeed's own:

- ``lite.setup(model, opt)`` calls ``deepspeed.initialize``; the engine is the model it
  returns. The optimizer it returns is the user's own torch optimizer, whose ``step`` goes
  through ``engine.step()`` (the engine reduces, clips, steps and zeroes gradients).
- ``lite.sharded_init()`` under ZeRO-3 records the build and partitions the parameters one at
  a time as the block closes (``deepspeed.zero.Init(module=...)``), each with the value a
  plain build gives it: no rank ever holds the whole model (``init.py``).
- ``lite.save`` writes the engine's sharded checkpoint directory; ``lite.load`` reads it, or
  any other checkpoint (converted as it is read).

DeepSpeed is imported when the strategy starts, never at ``import scopedlite``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch

from scopedlite._comm import distributed as _distributed
from scopedlite._core.structures import map_tensors
from scopedlite._io.canonical import OptimizerEntry, Tensors
from scopedlite._private.deepspeed_internals import is_zero3_partitioned
from scopedlite._strategies.base import Rendezvous, Strategy
from scopedlite._strategies.deepspeed import checkpoint as _checkpoint
from scopedlite._strategies.deepspeed.config import ZeroSettings, half_dtype
from scopedlite._strategies.deepspeed.counted import BackwardCounts
from scopedlite._strategies.deepspeed.crossing import refuse_stage_0
from scopedlite._strategies.deepspeed.engines import (
    EngineRecord,
    Engines,
    accumulating,
    clip_full_gradients,
    user_facing,
)
from scopedlite._strategies.deepspeed.init import zero3_build
from scopedlite._strategies.deepspeed.install import import_deepspeed
from scopedlite._strategies.deepspeed.join import DeepSpeedJoinHook
from scopedlite._strategies.deepspeed.logs import (
    Discard,
    filtered_warnings,
    quiet_deepspeed,
)
from scopedlite._strategies.deepspeed.torch_clipping import torch_clipping
from scopedlite._strategies.deepspeed.whole_counts import count_whole
from scopedlite._strategies.join.members import in_join
from scopedlite._strategies.lockstep import GatherLedger, Nesting
from scopedlite._strategies.process_group_strategy import ProcessGroupStrategy
from scopedlite._strategies.reroute import replace_method, reroute_step
from scopedlite._strategies.set_up import SetUpObjects, foreign_parameter, parameters_outside

if TYPE_CHECKING:
    from scopedlite._core.run import Placement

__all__ = ["DeepSpeedStrategy"]

# The variables DeepSpeed reads from the environment (LOCAL_RANK is required by its engine and
# by zero.Init). Our workers have them already; rank 0 of our launcher and forked workers do
# not, so the strategy sets them in its own process for the run and restores them in stop().
_WORLD_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DeepSpeedStrategy(ProcessGroupStrategy):
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
        self.settings = ZeroSettings(stage, config, offload_optimizer, offload_parameters)
        super().__init__(process_group_backend=process_group_backend)

    @property
    def stage(self) -> int:
        return self.settings.stage

    @property
    def offload_optimizer(self) -> bool:
        return self.settings.offload_optimizer

    @property
    def offload_parameters(self) -> bool:
        return self.settings.offload_parameters

    def fresh(self) -> DeepSpeedStrategy:
        fresh = super().fresh()
        assert isinstance(fresh, DeepSpeedStrategy)
        fresh.settings = copy.deepcopy(self.settings)
        return fresh

    def describe(self) -> str:
        return (
            f"DeepSpeedStrategy(stage={self.stage}, offload_optimizer={self.offload_optimizer}, "
            f"offload_parameters={self.offload_parameters})"
        )

    def build_config(self, precision: str, accelerator: str) -> dict[str, Any]:
        """The config handed to DeepSpeed: the user's, completed by the arguments."""
        return self.settings.build_config(precision, accelerator)

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        super().check(accelerator, world_size, precision)
        self.build_config(precision, accelerator)
        if importlib.util.find_spec("deepspeed") is None:  # refuse before any process starts
            import_deepspeed()

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The dtype DeepSpeed keeps the model in (None: fp32)."""
        return half_dtype(self.config)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        self.config = self.build_config(placement.precision.name, placement.accelerator)
        self._torch_clipping = contextlib.ExitStack()  # undone when the run stops
        self._saved_env: dict[str, str | None] = {}
        self._owns_group = False
        self._deepspeed_comm = False  # deepspeed.comm wraps our group
        self._log_level: int | None = None
        try:
            super().start(placement, rendezvous)
            self.engines = Engines(self.set_up)  # a view of the run's registry (weak: a dropped model is released)
            # torch.nn.utils.clip_grad_norm_(model.parameters(), ...) clips the engine's gradients
            self._torch_clipping.enter_context(torch_clipping(self.engines.records, self.every_rank_calls))
            self._counts = BackwardCounts()  # a step skipped on some ranks is refused (counted.py)
            self._owns_group = True
            self._start_deepspeed(placement, rendezvous)
            # ZeRO-3 gathers parameters for the user's methods too: each rank notes its
            # gathering steps, and a method called on some ranks only is refused (lockstep.py).
            # At stages 0-2 it notes its training forwards, for lite.save on some ranks only.
            self._ledger = (
                GatherLedger.of_default_group(
                    f"deepspeed_stage_{self.stage}", timeout=placement.timeout.total_seconds(), gathers=self.stage == 3
                )
                if placement.world_size > 1
                else None
            )
            self._counts.refused = self._ledger.realign if self._ledger is not None else None
        except BaseException:
            self.stop()  # leave no process group or environment variable behind
            raise

    def _start_deepspeed(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        assert rendezvous is not None
        world = rendezvous.world
        self._set_env(
            {
                "RANK": str(world.global_rank),
                "LOCAL_RANK": str(world.local_rank),
                "WORLD_SIZE": str(world.world_size),
                "LOCAL_WORLD_SIZE": str(world.local_world_size),
                "MASTER_ADDR": world.main_address,
                "MASTER_PORT": str(world.main_port),
            }
        )
        if placement.accelerator == "cpu" and "DS_ACCELERATOR" not in os.environ:
            self._set_env({"DS_ACCELERATOR": "cpu"})  # else DeepSpeed warns while detecting
        before = dict(os.environ)
        self.deepspeed = import_deepspeed()
        # Importing DeepSpeed sets PYTORCH_NVML_BASED_CUDA_CHECK for good; the run ends with
        # the environment it started with.
        for key in set(os.environ) - set(before):
            self._saved_env.setdefault(key, None)
        self._log_level = quiet_deepspeed()
        # DeepSpeed finds our process group and wraps it; it creates none of its own. Its
        # first call builds a small C++ op with gcc (cached in TORCH_EXTENSIONS_DIR) and prints
        # that it did on every rank: that print (main thread, Python-level) is dropped.
        with contextlib.redirect_stdout(Discard()):
            self.deepspeed.init_distributed(dist_backend=self._backend, timeout=placement.timeout)
        # A group made before launch (Ray Train, the script) outlives the run: DeepSpeed's view
        # of it stays true, and tearing it down through DeepSpeed would destroy it.
        self._deepspeed_comm = not world.is_existing_group

    def _set_env(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            if os.environ.get(key) == value:
                continue
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def stop(self) -> None:
        if getattr(self, "_torch_clipping", None) is not None:
            self._torch_clipping.close()
        # The run's registry ends first: each engine's hooks and buffers released, each
        # optimizer's own step given back (set_up.py).
        Strategy.stop(self)
        if self._deepspeed_comm:
            # Through DeepSpeed, which then forgets the groups it derived from this world (a
            # clone of it, cached in module globals): a later launch in this process would
            # otherwise hand the next engine a group of a world that is gone.
            _distributed.retire_groups()
            self.deepspeed.comm.destroy_process_group()
            self._deepspeed_comm = False
        if self._owns_group:
            super().stop()
            self._owns_group = False
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        if self._log_level is not None:
            self.deepspeed.utils.logger.setLevel(self._log_level)
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
        if optimizer is None and self.stage in (1, 2):
            raise ValueError(
                f"lite.setup(model) without an optimizer is not available under ZeRO stage "
                f"{self.stage}: DeepSpeed builds a stage-{self.stage} engine only around an "
                "optimizer. For a model that only evaluates (a teacher, a frozen encoder), use "
                "it without lite.setup (`model.to(lite.current().device)`; at stages 1-2 every "
                "rank holds all of it), or set it up with an optimizer you never step."
            )
        if optimizer is not None:
            _refuse_foreign_parameters(module, optimizer)
        with filtered_warnings():
            engine, _, _, _ = self.deepspeed.initialize(
                model=module.to(self.placement.device) if not is_zero3_partitioned(module) else module,
                optimizer=optimizer,
                config=copy.deepcopy(self.config),
                dist_init_required=False,
            )
        count_whole(engine.module, self.set_up.at_end)  # ZeRO-3: p.numel() is the whole count
        if self.half_dtype is not None:
            self._hook(engine.register_forward_pre_hook(_input_caster(self.half_dtype), with_kwargs=True))
        nesting = None
        if self._ledger is not None and self._ledger.gathers:  # ZeRO-3's methods gather: every rank must call them
            nesting = Nesting(self._ledger, engine.module)
            self._hook(engine.register_forward_pre_hook(nesting.enter, prepend=True))
            self._hook(engine.register_forward_hook(nesting.leave, always_call=True))
        # optimizer.step() and DeepSpeed's own model.step() take the engine's step
        step = None
        if optimizer is not None:
            # the ranks compare the optimizers that stepped at each backward (stepped.py)
            noted = self._counts.stepped.noter(optimizer) if self.placement.world_size > 1 else None
            step = _route_step_through_engine(optimizer, engine, self.set_up, self._before_step(engine, noted))
            if self.stage >= 1:  # the optimizer holds the engine's flat partitions
                hook = _checkpoint.refuse_plain_optimizer_state(self.stage)
                self.set_up.at_end(optimizer.register_load_state_dict_pre_hook(hook).remove)
        # What the user gets is the user's model (engines.py), released when dropped.
        model = user_facing(engine, self.backward_model, step, nesting)
        record = self.engines.add(model, engine, optimizer)
        if optimizer is not None and self.placement.world_size > 1:
            # the ranks compare their training forwards at each backward
            counts, place = self._counts, record.place
            counts.start()
            # at stages 0-2 the ledger notes the training forwards counted (ZeRO-3's hook above)
            noted = self._note_forward if self._ledger is not None and not self._ledger.gathers else None
            self._hook(engine.register_forward_pre_hook(lambda *_: counts.forward(place, noted)))
        return model, [] if optimizer is None else [optimizer]

    def _hook(self, handle: Any) -> None:
        """A hook of ours on an engine, removed when the run ends (if the engine outlives it)."""
        self.set_up.at_end(handle.remove)

    def _before_step(self, engine: Any, noted: Callable[[], None] | None) -> Callable[[], None]:
        """What runs just before each step of ``engine`` that the user's ``optimizer.step()``
        (or DeepSpeed's own ``model.step()``) takes: a step with no backward since the last is
        refused (``EngineRecord.refuse_unbacked_step``), then ``noted`` (stepped.py) is told,
        and the gather ledger (outside ``lite.join``)."""

        def before() -> None:
            record = self.engines.of_engine(engine)
            if record is not None:
                record.refuse_unbacked_step(self.stage)
            if noted is not None:
                noted()
            if self._ledger is not None and not in_join():  # a rank calling something alone learns it
                self._ledger.optimizer_step()

        return before

    def note_synced(self, model: torch.nn.Module) -> None:
        """A backward of ``model``'s engine at an accumulation boundary ran outside
        ``lite.backward`` (a joined rank's replay): the next step has gradients."""
        record = self.engines.record(model)
        if record is not None and record.engine.is_gradient_accumulation_boundary():
            record.synced_at = record.engine.global_steps

    def engine(self, model: torch.nn.Module) -> Any:
        """The ``deepspeed.DeepSpeedEngine`` behind ``model`` (what ``lite.setup`` returned):
        DeepSpeed's own API, e.g. ``lite.current().strategy.engine(model).global_steps``."""
        return self._record(model, "strategy.engine").engine

    def optimizer_of(self, model: torch.nn.Module) -> torch.optim.Optimizer | None:
        """The optimizer ``model`` was set up with (None: set up for evaluation)."""
        return self._record(model, "strategy.optimizer_of").optimizer

    def model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
        """The set-up model whose engine ``optimizer`` steps, if any."""
        return self.engines.face_of_optimizer(optimizer)  # type: ignore[no-any-return]

    def load_weights(self, module: torch.nn.Module, weights: Any, strict: bool) -> None:
        """Into the partitions (ZeRO-3) or the replicas, then into the optimizer's fp32 master
        copies, or its next step would bring the old weights back."""
        super().load_weights(module, weights, strict)
        record = self.engines.record(module)
        refresh = getattr(record.engine.optimizer, "refresh_fp32_params", None) if record is not None else None
        if refresh is not None:
            refresh()

    def compile_target(self, module: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside the engine, as DeepSpeed's own ``engine.compile()`` does."""
        return self.unwrap(module)

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        record = self.engines.record(module)
        return record.engine.module if record is not None else module

    def module_init_context(self, empty: bool) -> ContextManager[Any]:
        """Under ZeRO-3, parameters are partitioned as the block closes, one at a time, with
        the values a plain build gives them (``deepspeed/init.py``); stages 1-2 build plainly."""
        if self.stage != 3:
            return super().module_init_context(empty)
        return zero3_build(
            self.deepspeed,
            self.config,
            empty,
            agree=lambda obj: self.broadcast(obj, src=0),
            device=self.placement.device,
            dtype=self.half_dtype,
            remote_device="cpu" if self.offload_parameters else None,
            init_dtype=self.placement.precision.init_dtype(),
        )

    @property
    def _engines(self) -> list[Any]:
        """The models of this run still referenced by the user, in setup order."""
        return self.engines.alive()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_model(loss, None, *args, **kwargs)

    def backward_model(self, loss: torch.Tensor, model: torch.nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """``engine.backward(loss)`` on the engine that produced ``loss`` (or ``model``)."""
        if args or kwargs:
            raise TypeError(
                "lite.backward(loss) under strategy='deepspeed' takes the loss only (it calls "
                f"engine.backward(loss)); got extra arguments {args!r} {kwargs!r}."
            )
        record = self.engines.for_backward(loss, model, self.deepspeed.DeepSpeedEngine, self.stage)
        engine = record.engine
        synced = engine.is_gradient_accumulation_boundary()
        unstepped = record.synced_at == engine.global_steps
        if synced and self.stage < 3 and engine.gradient_accumulation_steps() == 1 and unstepped:
            # ZeRO 1/2 replace, not add, the gradients of an earlier backward at a boundary.
            raise RuntimeError(
                "lite.backward was called twice before optimizer.step() under strategy="
                f"'deepspeed' (ZeRO stage {self.stage}): DeepSpeed would keep only the second "
                "backward's gradients. To accumulate, wrap every backward but the last in "
                "`with lite.no_backward_sync(model):` (as under DDP), or call optimizer.step() "
                "in between."
            )
        self._note_backward()
        with filtered_warnings(), self._counts.compared(record.place, synced or self.stage >= 2):
            try:
                engine.backward(loss)
            except RuntimeError as e:
                # Stage 0, through another engine's forward (even one with frozen parameters)
                if self.stage == 0 and "Direct calls to tensor.backward()" in str(e):
                    raise refuse_stage_0(record.name) from e
                raise
        if synced:
            record.synced_at = engine.global_steps

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        """Accumulate: backward passes inside add to the gradients and the next one outside
        ends the window, so the result is DDP's. ZeRO still reduces gradients in every
        backward (stages 2-3 partition them as they are reduced): it saves no communication."""
        engine = self._record(module, "lite.no_backward_sync").engine
        return accumulating(engine) if enabled else contextlib.nullcontext()

    def clips_together(self, by_norm: bool) -> bool:
        return True  # the engine's full gradients are gathered to clip them

    def clip_gradients(self, module, optimizer, max_norm, clip_val, norm_type=2.0):  # type: ignore[no-untyped-def]
        """Clip the full gradients between backward and step, as DDP's are clipped."""
        record = self._record(module, "lite.clip_gradients")
        if record.optimizer is not optimizer:
            raise ValueError(
                "lite.clip_gradients(model, optimizer, ...) under strategy='deepspeed' needs the "
                "optimizer set up together with that model: `model, opt = lite.setup(model, opt)`."
            )
        with filtered_warnings():
            return clip_full_gradients(record.engine, max_norm, clip_val, norm_type)

    def _record(self, module: Any, caller: str) -> EngineRecord:
        record = self.engines.record(module)
        if record is None:
            raise TypeError(
                f"{caller} needs the model returned by lite.setup, got a plain "
                f"{type(module).__name__}. Use `model, opt = lite.setup(model, opt)` first."
            )
        return record

    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Any:
        # inside the block the ranks run different numbers of their own forwards on purpose
        self._counts.pause(True)
        return super().join(joinables, divide_by_initial_world_size)

    def join_left(self) -> None:
        super().join_left()
        self._counts.pause(False)  # every rank leaves here together: the counts start again

    def join_models(self) -> list[torch.nn.Module]:
        return self._engines

    def join_optimizers(self, models: tuple[torch.nn.Module, ...]) -> tuple[torch.optim.Optimizer, ...]:
        optimizers = tuple(self.optimizer_of(engine) for engine in models)
        if any(o is None for o in optimizers) and not all(o is None for o in optimizers):
            raise ValueError(
                "lite.join under strategy='deepspeed' takes either models set up with their "
                "optimizer (training) or models set up alone (evaluation), not both at once. "
                "Use one join block for each."
            )
        return tuple(o for o in optimizers if o is not None)

    def join_hook(
        self, models: tuple[Any, ...], optimizers: tuple[torch.optim.Optimizer, ...], divide_by_initial_world_size: bool
    ) -> DeepSpeedJoinHook:
        return DeepSpeedJoinHook(self, models, divide_by_initial_world_size, self.placement.world_size)

    # -- checkpoints: the engine's own folder; any checkpoint loaded (see checkpoint.py) --
    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any]) -> None:
        _checkpoint.save_checkpoint(self, path, state)

    def load_native(self, checkpoint: Any, state: dict[str, Any], strict: bool) -> list[str]:
        return _checkpoint.load_native(self, checkpoint, state, strict)

    def load_module_from(self, module: torch.nn.Module, tensors: Tensors, strict: bool) -> None:
        record = self.engines.record(module)
        if record is not None:
            _checkpoint.load_engine(record.engine, record.optimizer, tensors, strict)
        else:
            super().load_module_from(module, tensors, strict)

    def load_optimizer_from(
        self, optimizer: torch.optim.Optimizer, entry: OptimizerEntry, modules: Sequence[torch.nn.Module]
    ) -> None:
        model = self.model_of(optimizer)
        if model is None:
            super().load_optimizer_from(optimizer, entry, modules)
        else:
            _checkpoint.load_engine_optimizer(self.engine(model), optimizer, entry)


def _route_step_through_engine(
    optimizer: torch.optim.Optimizer, engine: Any, set_up: SetUpObjects, before: Callable[[], None]
) -> Callable[..., Any]:
    """Make ``optimizer.step()`` run ``engine.step()`` and ``zero_grad()`` leave the gradients
    to the engine; the engine's own calls into the optimizer reach the real methods.

    Rerouted on the instance for the run (see ``reroute.py``), so the optimizer keeps its class
    and LR schedulers built on it keep working. Returns what DeepSpeed's own ``model.step()``
    runs: ``engine.step()`` marked as the engine's, so that its call into the optimizer reaches
    the real step there too (before, it was rerouted back into a second ``engine.step()``).
    ``before``: run just before each engine step (it may refuse the step).
    """
    original_zero_grad = optimizer.zero_grad

    def engine_step(*args: Any, **kwargs: Any) -> Any:
        before()
        with filtered_warnings():
            return engine.step(*args, **kwargs)

    route = reroute_step(
        optimizer,
        engine_step,
        "optimizer.step(closure) cannot be used under strategy='deepspeed': the engine steps "
        "after lite.backward(loss). Call optimizer.step() without a closure.",
        set_up,
    )

    def zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        # The engine zeroes its (partitioned) gradients itself after each step it takes; with
        # gradient accumulation a user's zero_grad between micro-batches must not erase them.
        if route.inside:
            original_zero_grad(set_to_none=set_to_none)

    replace_method(optimizer, "zero_grad", zero_grad, set_up)

    def model_step(*args: Any, **kwargs: Any) -> Any:
        with route.taking():
            return engine_step(*args, **kwargs)

    return model_step


def _input_caster(dtype: torch.dtype) -> Any:
    """A forward pre-hook casting floating inputs to the dtype DeepSpeed holds the model in
    (its bf16/fp16 modes convert the whole model, unlike torch autocast)."""

    def cast(_: Any, args: Any, kwargs: Any) -> Any:
        def convert(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() else t

        return map_tensors(args, convert), map_tensors(kwargs, convert)

    return cast


def _refuse_foreign_parameters(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed's engine steps the optimizer over its model's parameters: one of another
    module fails deep inside ``deepspeed.initialize`` (a ``KeyError``, or at stage 3 an
    ``AttributeError``), so it is refused first, naming it."""
    for index, param in parameters_outside(optimizer, {id(p) for p in module.parameters()}):
        raise foreign_parameter(
            index, param, "that is not one of the model's", ": the DeepSpeed engine steps only its model's"
        )
