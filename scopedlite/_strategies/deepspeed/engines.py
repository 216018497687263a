"""The engines of one DeepSpeed run: several models, found by the loss, released when dropped.

A DeepSpeed engine is the model ``lite.setup`` returns and it owns the backward, the step, the
gradients and the clipping. What DDP users write must keep working:

- several models in one run (a new model per fold, a GAN, a fresh model to load a checkpoint
  into): the run keeps weak references only, and ``lite.backward(loss)`` walks the loss's
  autograd graph to the parameters it reached to find the engine that produced it;
- ``lite.no_backward_sync`` for accumulation: the engine's gradient-accumulation boundary
  (``set_gradient_accumulation_boundary``, public API) is lowered inside the block;
- ``lite.clip_gradients`` by norm or by value, between backward and step, on the full
  gradients DeepSpeed assembles (``deepspeed.utils.safe_get_full_grad`` and
  ``safe_update_full_grad_vectorized``, public API);
- the set-up model is the user's model (:class:`EngineView`): the names of the user's module
  (``model.config``, ``model.generate``, any attribute, even one the engine also has) are the
  user's; every other name is the engine's, except DeepSpeed's own ``model.backward(loss)``
  and ``model.step()``, which are ``lite.backward(loss)`` and ``optimizer.step()``;
- a model the user drops is released. DeepSpeed's gradient hooks live on the parameters, in
  C++, and point back at the engine: an engine is never garbage, so its drop cannot be seen
  on it. The user is therefore handed a *second face* of the engine (:func:`user_facing`),
  an object of the engine's class (with the view mixed in: ``user_model.py``'s one
  mechanism) that holds nothing but the engine and answers every name from it or from the
  user's module, and that nothing of DeepSpeed references: when the user lets go of it,
  ``engine.destroy()`` removes the hooks and the engine, its optimizer and its parameters
  are freed.

What the run knows about each engine (its optimizer, its parameters, the backward passes since
the last step, how to release it) is its :class:`EngineRecord`, kept in the run's registry
(``_strategies/set_up.py``) and read through :class:`Engines`; nothing is written onto
DeepSpeed's objects. What the face itself must know (the engine, and under ZeRO-3 the
:class:`~scopedlite._strategies.lockstep.Nesting` its methods count in) is in slots of the
face, which is ours; its own ``__dict__`` stays empty. A call of the face is a call of the
engine, with DeepSpeed's warnings filtered (ZeRO-3 gathers parameters inside its forward).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from scopedlite._private.deepspeed_internals import forget_forward_stack, is_zero3_parameter
from scopedlite._private.torch_internals import registered_submodule
from scopedlite._strategies.deepspeed.crossing import leaves_reached, refuse_crossing
from scopedlite._strategies.deepspeed.logs import filtered_warnings
from scopedlite._strategies.deepspeed.methods import through_forward
from scopedlite._strategies.lockstep import Nesting, gathering_together
from scopedlite._strategies.set_up import SetUpObjects
from scopedlite._strategies.user_model import UserModelView, saving_method, user_owns, view_class

__all__ = ["EngineRecord", "EngineView", "Engines", "accumulating", "clip_full_gradients", "user_facing"]


class EngineView(UserModelView):
    """A DeepSpeed engine that is the user's model (mixed in by ``view_class``).

    Names resolve in this order: the face's own (this class's methods, dunders); the user's
    module's own names (see ``user_owns``: its attributes, submodules, and everything its
    classes define, e.g. a Hugging Face model's ``config``, ``generate``, ``device``); then
    the engine's, bound to the engine itself, so DeepSpeed's code never sees the user's names
    (an engine method that returns the engine returns this face instead). Setting a name the
    user's module owns sets it there.

    Under ZeRO-3 each rank holds a slice of every parameter: ``state_dict()`` gathers the
    full values (every rank must call it, as every rank calls forward: a call on some ranks
    only, or inside ``lite.join``, is refused before it gathers) and ``load_state_dict()``
    scatters them again. After a load, the optimizer's fp32 master
    copies are refreshed from the loaded weights, or its next step would bring the old ones
    back.
    """

    # The engine object itself, the Nesting of ZeRO-3's methods (None: they gather on one
    # rank, or not at all), the strategy's checked backward and the optimizer's step (None:
    # no optimizer): slots of the face (every other name is the engine's or the user's).
    __slots__ = ("_lite_engine", "_lite_face_backward", "_lite_face_nesting", "_lite_face_step")

    def __getattribute__(self, name: str) -> Any:
        if name in _FACE_NAMES or (name.startswith("__") and name.endswith("__")):
            return object.__getattribute__(self, name)
        engine = object.__getattribute__(self, "_lite_engine")
        inner = registered_submodule(engine, "module")
        if inner is not None and user_owns(inner, name):
            return object.__getattribute__(self, "_lite_user_attribute")(inner, name)
        value = getattr(engine, name)
        if callable(value) and getattr(value, "__self__", None) is engine:
            return _answering_for(self, engine, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        engine = object.__getattribute__(self, "_lite_engine")
        inner = registered_submodule(engine, "module")
        setattr(inner if inner is not None and user_owns(inner, name) else engine, name, value)

    def __delattr__(self, name: str) -> None:
        engine = object.__getattribute__(self, "_lite_engine")
        inner = registered_submodule(engine, "module")
        delattr(inner if inner is not None and user_owns(inner, name) else engine, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        inner = self._lite_module()
        if not _partitioned(self) or kwargs.get("keep_vars"):
            return inner.state_dict(*args, **kwargs)
        import deepspeed

        with (
            self._lite_together(f"{type(inner).__name__}.state_dict"),
            deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None),
        ):
            state = inner.state_dict(*args, **kwargs)
            for key, value in state.items():  # the gathered storage is freed on exit
                if isinstance(value, torch.Tensor):
                    state[key] = value.detach().clone()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        inner = self._lite_module()
        if _partitioned(self):
            import deepspeed

            # Every rank loads the same values; rank 0's are scattered on exit.
            with (
                self._lite_together(f"{type(inner).__name__}.load_state_dict"),
                deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=0),
            ):
                result = inner.load_state_dict(state_dict, strict=strict, assign=assign)
        else:
            result = inner.load_state_dict(state_dict, strict=strict, assign=assign)
        refresh = getattr(self._lite_engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()
        return result

    def _lite_saving_method(self, method: Callable[..., Any], name: str) -> Any:
        """``save_pretrained`` under ZeRO-3: every rank calls it; the parameters are gathered
        one at a time and rank 0 writes the plain model's full weights."""
        if not _partitioned(self):
            return method
        inner = self._lite_module()
        return saving_method(
            method, functools.partial(_gathered_state, inner), functools.partial(self._lite_together, name)
        )

    def _lite_together(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Every rank gathers with this one, or it is refused (``lockstep.gathering_together``);
        ``name`` as errors call it (``"GPT.state_dict"``)."""
        nesting = object.__getattribute__(self, "_lite_face_nesting")
        inner = self._lite_module()
        return gathering_together(nesting, inner, name)

    def _lite_inner(self) -> torch.nn.Module | None:
        return registered_submodule(object.__getattribute__(self, "_lite_engine"), "module")

    # DeepSpeed's own model.backward and model.step are the face's: the checked ones below
    # (lite.join wraps the engine's own for its block, which these reach)
    @property
    def backward(self) -> Callable[..., Any]:
        """DeepSpeed's own ``model.backward(loss)`` runs as ``lite.backward(loss)`` does, with
        its checks (a step skipped on one rank is refused, not reduced with another step's);
        with DeepSpeed's extra arguments (``retain_graph=True``) it is the engine's, unchecked."""
        return functools.partial(_checked_backward, self)

    @property
    def step(self) -> Callable[..., Any]:
        """DeepSpeed's own ``model.step()`` is ``optimizer.step()``: the engine's step, whose
        call into the user's optimizer reaches its real step."""
        step = object.__getattribute__(self, "_lite_face_step")
        return step if step is not None else object.__getattribute__(self, "_lite_engine").step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A call of the engine, quiet: ZeRO-3 gathers parameters inside its forward."""
        engine = object.__getattribute__(self, "_lite_engine")
        with filtered_warnings():
            return engine(*args, **kwargs)

    def _lite_method(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        """The user's method, through the engine's forward where it needs to be (methods.py)."""
        inner = self._lite_module()
        nesting = object.__getattribute__(self, "_lite_face_nesting")
        return through_forward(self, inner, method, name, nesting, _partitioned(self))


_FACE_NAMES = frozenset(
    name for klass in (EngineView, UserModelView) for name in vars(klass) if name not in ("__getattr__",)
) | {"_lite_engine"}


def _checked_backward(face: Any, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:
        engine = object.__getattribute__(face, "_lite_engine")
        with filtered_warnings():
            return engine.backward(loss, *args, **kwargs)
    object.__getattribute__(face, "_lite_face_backward")(loss, face)
    return loss  # as DeepSpeed's returns it


def _partitioned(face: Any) -> bool:
    return bool(object.__getattribute__(face, "_lite_engine").zero_optimization_stage() == 3)


def _answering_for(face: Any, engine: Any, method: Any) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        return face if result is engine else result  # `model = model.to(device)` keeps the face

    return call


def _gathered_state(inner: torch.nn.Module) -> dict[str, Any]:
    """The full state dict of a ZeRO-3 module on rank 0 (empty elsewhere), gathered one
    parameter at a time; tied parameters stay one tensor under their names."""
    import deepspeed

    rank = torch.distributed.get_rank()
    state: dict[str, Any] = {}
    copies: dict[int, torch.Tensor] = {}
    for key, value in inner.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.nn.Parameter) or not is_zero3_parameter(value):
            if rank == 0:
                state[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
            continue
        if id(value) not in copies:
            with deepspeed.zero.GatheredParameters([value], modifier_rank=None):
                copies[id(value)] = value.detach().clone() if rank == 0 else torch.empty(0)
        if rank == 0:
            state[key] = copies[id(value)]
    return state


def user_facing(
    engine: Any,
    backward: Callable[[torch.Tensor, Any], None],
    step: Callable[..., Any] | None,
    nesting: Nesting | None = None,
) -> Any:
    """The object ``lite.setup`` returns for ``engine`` (see the module docstring).

    It is an instance of a subclass of the engine's class with :class:`EngineView` mixed in
    that answers every name from the engine (or the user's module): every hook and attribute
    is the engine's, so DeepSpeed and ``isinstance(model, DeepSpeedEngine)`` see no
    difference, but it is a different object, held only by the user. ``backward(loss,
    face)``: the strategy's checked backward, which ``model.backward(loss)`` runs;
    ``step``: what ``model.step()`` runs (the set-up optimizer's step; None: the engine's).
    ``nesting``: where the user's methods are counted when they gather over several ranks
    (ZeRO-3).
    """
    face = object.__new__(view_class(type(engine), EngineView, "SetUpDeepSpeedEngine"))
    object.__setattr__(face, "_lite_engine", engine)
    object.__setattr__(face, "_lite_face_backward", backward)
    object.__setattr__(face, "_lite_face_step", step)
    object.__setattr__(face, "_lite_face_nesting", nesting)
    return face


@dataclass(eq=False)
class EngineRecord:
    """What the run knows about one engine (keyed by the face the user holds).

    Attributes:
        name: How errors name the model: its class and its place in setup order.
        synced_at: The engine's ``global_steps`` at its last backward at an accumulation
            boundary (None: none yet): a backward at a boundary while it is still the same
            has not been stepped (by ``optimizer.step()`` or DeepSpeed's own ``model.step()``).
        place: Its place in setup order (the same on every rank).
    """

    engine: Any
    optimizer: torch.optim.Optimizer | None
    parameter_ids: frozenset[int]
    release: weakref.finalize
    name: str
    synced_at: int | None = field(default=None)
    place: int = field(default=0)

    def refuse_unbacked_step(self, stage: int) -> None:
        """Refuse the engine step about to be taken where no backward at an accumulation
        boundary came since the engine's last step (a second ``optimizer.step()``, one before
        any backward, or one on some ranks only: ``if rank == 0: opt.step()``). At ZeRO
        stages 1-3 the engine's optimizer frees its gradient partitions at each step, and
        DeepSpeed fails deep inside such a step (``TypeError: 'NoneType' object is not
        iterable``, from its norm of gradients it no longer holds); at stage 0 it steps the
        torch optimizer, as plain torch would. A micro-step inside the engine's own
        accumulation only counts. Raised before the engine is called: nothing changed, and a
        rank that catches it is still in step with the others."""
        engine = self.engine
        if stage == 0 or not engine.is_gradient_accumulation_boundary() or self.synced_at == engine.global_steps:
            return
        since = "before any backward" if self.synced_at is None else "with no backward since the previous step"
        raise RuntimeError(
            f"optimizer.step() was called {since} under strategy='deepspeed' (ZeRO stage {stage}), "
            f"for {self.name}: the engine frees its gradients at each step, so this step would have "
            "none (DeepSpeed itself fails with `TypeError: 'NoneType' object is not iterable`). "
            "Under plain torch such a step reuses the gradients still held, or does nothing after "
            "zero_grad(). Call lite.backward(loss) before each optimizer.step(), on every rank: a "
            "step taken on some ranks only (`if rank == 0: opt.step()`) is never right."
        )


def _release(engine: Any) -> None:
    engine.destroy()
    forget_forward_stack(engine.module)


class Engines:
    """The run's set-up DeepSpeed models (faces) in setup order, with their records: a view of
    the run's registry (``_strategies/set_up.py``), which holds them weakly."""

    def __init__(self, set_up: SetUpObjects) -> None:
        self._set_up = set_up

    def add(self, face: Any, engine: Any, optimizer: torch.optim.Optimizer | None) -> EngineRecord:
        """Register ``face``; ``engine.destroy()`` runs once, when the user drops the face or
        the run ends (local work only, no collective: ranks may drop a model at different
        moments)."""
        record = EngineRecord(
            engine=engine,
            optimizer=optimizer,
            parameter_ids=frozenset(id(p) for p in engine.module.parameters()),
            release=weakref.finalize(face, _release, engine),
            name=type(engine.module).__name__,
        )
        place = self._set_up.add_model(face, record)
        record.name = f"{record.name} (model {place} set up in this run)"
        record.place = place
        self._set_up.at_end(record.release)
        return record

    def alive(self) -> list[Any]:
        return self._set_up.models()

    def records(self) -> list[EngineRecord]:
        """The records of the engines alive, in setup order."""
        return [self._record_of(face) for face in self.alive()]

    def record(self, face: Any) -> EngineRecord | None:
        record = self._set_up.record(face)
        return record if isinstance(record, EngineRecord) else None

    def _record_of(self, face: Any) -> EngineRecord:
        record = self.record(face)
        assert record is not None, "a set-up model without its engine's record"
        return record

    def of_engine(self, engine: Any) -> EngineRecord | None:
        """The record of ``engine`` (None: its face was dropped)."""
        return next((r for r in self.records() if r.engine is engine), None)

    def face_of_optimizer(self, optimizer: Any) -> Any:
        return next((f for f in self.alive() if self._record_of(f).optimizer is optimizer), None)

    def for_backward(self, loss: torch.Tensor, model: Any, engine_class: type, stage: int) -> EngineRecord:
        """The engine ``lite.backward(loss, model=model)`` must drive. A loss that would also
        give gradients to another engine's parameters (a GAN's generator loss through the
        discriminator) is refused with the way out (crossing.py). The loss's graph is walked
        only when the run has several models."""
        engines = self.alive()
        leaves = leaves_reached(loss) if len(engines) > 1 and getattr(loss, "grad_fn", None) is not None else []
        record = self._target(loss, model, engine_class, engines, leaves)
        refuse_crossing(record, [self._record_of(e) for e in engines], leaves, stage)
        return record

    def _target(
        self, loss: torch.Tensor, model: Any, engine_class: type, engines: list[Any], leaves: list[torch.Tensor]
    ) -> EngineRecord:
        if model is not None:
            if not isinstance(model, engine_class) or not any(model is e for e in engines):
                raise TypeError(
                    f"lite.backward(loss, model=...) takes a model returned by lite.setup in this "
                    f"run, got a {type(model).__name__}. Pass the set-up model: "
                    "`model, opt = lite.setup(model, opt)` ... `lite.backward(loss, model=model)`."
                )
            return _needs_optimizer(self._record_of(model))
        if len(engines) == 1:
            return _needs_optimizer(self._record_of(engines[0]))
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            raise RuntimeError(
                "lite.backward got a loss that does not require grad: it was computed without "
                "gradients (torch.no_grad, or from detached tensors) and there is nothing to "
                "backpropagate."
            )
        reached = {id(leaf) for leaf in leaves}
        found = [r for r in map(self._record_of, engines) if r.parameter_ids & reached]
        training = [r for r in found if r.optimizer is not None]
        if len(training) == 1:
            return training[0]
        names = ", ".join(type(r.engine.module).__name__ for r in found) or "none"
        if not found:
            raise RuntimeError(
                f"lite.backward: the loss depends on none of the {len(engines)} models set up in "
                "this run. Compute it from the output of a model returned by lite.setup."
            )
        if not training:
            raise RuntimeError(
                f"lite.backward: the loss depends only on models set up without an optimizer "
                f"({names}); set the one to train up with it: `model, opt = lite.setup(model, opt)`."
            )
        raise RuntimeError(
            f"lite.backward: under strategy='deepspeed' each model's engine runs its own backward, "
            f"and this loss depends on {len(training)} models set up with optimizers ({names}). "
            "Say which one this loss trains: `lite.backward(loss, model=model)`."
        )


def _needs_optimizer(record: EngineRecord) -> EngineRecord:
    if record.optimizer is None:
        raise RuntimeError(
            f"lite.backward: the {type(record.engine.module).__name__} was set up without an optimizer "
            "(evaluation only), so DeepSpeed cannot train it. Set it up with its optimizer: "
            "`model, opt = lite.setup(model, opt)`."
        )
    return record


@contextlib.contextmanager
def accumulating(engine: Any) -> Iterator[None]:
    """Backward passes inside add to the gradients without ending the accumulation window.

    With the engine's own accumulation (``gradient_accumulation_steps`` > 1 in the config)
    the engine already counts micro-batches: nothing to do.
    """
    if engine.gradient_accumulation_steps() > 1:
        yield
        return
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(True)


def clip_full_gradients(
    engine: Any, max_norm: float | None, clip_val: float | None, norm_type: float = 2.0
) -> torch.Tensor | None:
    """Clip the engine's gradients as ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``
    clip DDP's: on the full, already averaged gradients (every rank must call it)."""
    from deepspeed.utils import safe_get_full_grad

    params = [p for p in engine.module.parameters() if p.requires_grad]
    if max_norm is None:
        _update_gradients(engine, params, lambda grad: grad.clamp(-clip_val, clip_val))
        return None
    grads = [grad.detach().float() for grad in (safe_get_full_grad(p) for p in params) if grad is not None]
    norms = [torch.linalg.vector_norm(grad, norm_type) for grad in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros(())
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _update_gradients(engine, params, lambda grad: grad * coefficient.to(grad.device, grad.dtype))
    return total


def _update_gradients(engine: Any, params: list[torch.nn.Parameter], change: Any) -> None:
    """Apply the element-wise ``change`` (which keeps 0 at 0) to every gradient.

    ZeRO-3: on each rank's own partition of each gradient (``safe_get_local_grad``): DeepSpeed
    0.19's full-gradient setters cut a parameter smaller than the world size past its end.
    """
    from deepspeed.utils import (
        safe_get_local_grad,
        safe_set_local_grad,
        safe_update_full_grad_vectorized,
    )

    if engine.zero_optimization_stage() == 3:
        for param in params:
            local = safe_get_local_grad(param)
            if local is not None:
                safe_set_local_grad(param, change(local))
    else:
        safe_update_full_grad_vectorized(params, lambda grad, _: change(grad))
