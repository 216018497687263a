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
- the engine answers the user's attributes and methods, and its state dict is the plain
  module's (:class:`EngineView`);
- a model the user drops is released. DeepSpeed's gradient hooks live on the parameters, in
  C++, and point back at the engine: an engine is never garbage, so its drop cannot be seen
  on it. The user is therefore handed a *second face* of the engine (:func:`user_facing`),
  which shares the engine's attributes (one ``__dict__``) and class, and which nothing of
  DeepSpeed references: when the user lets go of it, ``engine.destroy()`` removes the hooks
  and the engine, its optimizer and its parameters are freed.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from scopedlite._private.deepspeed_internals import forget_forward_stack
from scopedlite._strategies.user_model import (
    UserModelView,
    user_method_names,
    view_class,
)

__all__ = ["EngineView", "Engines", "accumulating", "clip_full_gradients", "release_engine", "user_facing", "warn_shadowed"]


class EngineView(UserModelView):
    """A DeepSpeed engine that answers for the user's module (mixed in by ``view_class``).

    Under ZeRO-3 each rank holds a slice of every parameter: ``state_dict()`` gathers the
    full values (every rank must call it, as every rank calls forward) and
    ``load_state_dict()`` scatters them again. After a load, the optimizer's fp32 master
    copies are refreshed from the loaded weights, or its next step would bring the old ones
    back.
    """

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        inner = self._lite_inner()
        assert inner is not None
        if self.zero_optimization_stage() != 3 or kwargs.get("keep_vars"):
            return inner.state_dict(*args, **kwargs)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None):
            state = inner.state_dict(*args, **kwargs)
            for key, value in state.items():  # the gathered storage is freed on exit
                if isinstance(value, torch.Tensor):
                    state[key] = value.detach().clone()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        inner = self._lite_inner()
        assert inner is not None
        if self.zero_optimization_stage() == 3:
            import deepspeed

            # Every rank loads the same values; rank 0's are scattered on exit.
            with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=0):
                result = inner.load_state_dict(state_dict, strict=strict, assign=assign)
        else:
            result = inner.load_state_dict(state_dict, strict=strict, assign=assign)
        refresh = getattr(self.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()
        return result


def warn_shadowed(engine: Any) -> list[str]:
    """Warn about the user's attributes and methods the engine has names of its own for.

    The engine stays the object DeepSpeed calls into (``self.step``, ``self.config``, ...), so
    its own names keep their meaning there and on the set-up model; the user's are then
    reached through ``model.module``. Returns the names.
    """
    inner = engine.module
    own = [name for name in vars(inner) if not name.startswith("_") and name != "training"]
    children = [name for name, _ in (*inner.named_parameters(recurse=False), *inner.named_buffers(recurse=False), *inner.named_children())]
    candidates = [*own, *children, *user_method_names(type(inner))]
    shadowed = sorted({n for n in candidates if n != "module" and (hasattr(type(engine), n) or n in vars(engine))})
    if shadowed:
        warnings.warn(
            f"Under strategy='deepspeed' the model lite.setup returns is DeepSpeed's engine, which "
            f"has attributes of its own named {shadowed}: on the set-up model they are the "
            f"engine's. Reach your {type(inner).__name__}'s as `model.module.{shadowed[0]}`, or "
            "rename them.",
            stacklevel=4,
        )
    return shadowed


def user_facing(engine: Any, always_through_forward: bool) -> Any:
    """The object ``lite.setup`` returns for ``engine`` (see the module docstring).

    It is an instance of a subclass of the engine's class with :class:`EngineView` mixed in,
    sharing the engine's ``__dict__``: every attribute, hook and method is the engine's, so
    DeepSpeed and ``isinstance(model, DeepSpeedEngine)`` see no difference, but it is a
    different object, held only by the user.
    """
    face = object.__new__(view_class(type(engine), EngineView, "SetUpDeepSpeedEngine"))
    object.__setattr__(face, "__dict__", engine.__dict__)
    face.lite_always_through_forward = always_through_forward
    face._lite_release = weakref.finalize(face, _release, engine)
    return face


def _release(engine: Any) -> None:
    engine.destroy()
    forget_forward_stack(engine.module)


def release_engine(model: Any) -> None:
    """``engine.destroy()`` once, now (the run ends) or when the user drops ``model``. Local
    work only, no collective: ranks may drop a model at different moments."""
    model._lite_release()


class Engines:
    """Weak references to the run's engines, in setup order."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Any]] = []

    def add(self, engine: Any) -> None:
        self._refs = [r for r in self._refs if r() is not None]
        self._refs.append(weakref.ref(engine))
        engine._lite_parameter_ids = frozenset(id(p) for p in engine.module.parameters())

    def alive(self) -> list[Any]:
        return [e for e in (r() for r in self._refs) if e is not None]

    def for_backward(self, loss: torch.Tensor, model: Any, engine_class: type) -> Any:
        """The engine ``lite.backward(loss, model=model)`` must drive."""
        engines = self.alive()
        if model is not None:
            if not isinstance(model, engine_class) or not any(model is e for e in engines):
                raise TypeError(
                    f"lite.backward(loss, model=...) takes a model returned by lite.setup in this "
                    f"run, got a {type(model).__name__}. Pass the set-up model: "
                    "`model, opt = lite.setup(model, opt)` ... `lite.backward(loss, model=model)`."
                )
            _needs_optimizer(model)
            return model
        if len(engines) == 1:
            _needs_optimizer(engines[0])
            return engines[0]
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            raise RuntimeError(
                "lite.backward got a loss that does not require grad: it was computed without "
                "gradients (torch.no_grad, or from detached tensors) and there is nothing to "
                "backpropagate."
            )
        reached = _parameters_reached(loss)
        found = [e for e in engines if e._lite_parameter_ids & reached]
        training = [e for e in found if getattr(e, "_lite_user_optimizer", None) is not None]
        if len(training) == 1:
            return training[0]
        names = ", ".join(type(e.module).__name__ for e in found) or "none"
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


def _needs_optimizer(engine: Any) -> None:
    if getattr(engine, "_lite_user_optimizer", None) is None:
        raise RuntimeError(
            f"lite.backward: the {type(engine.module).__name__} was set up without an optimizer "
            "(evaluation only), so DeepSpeed cannot train it. Set it up with its optimizer: "
            "`model, opt = lite.setup(model, opt)`."
        )


def _parameters_reached(loss: torch.Tensor) -> frozenset[int]:
    """The ids of the leaf tensors (parameters) whose gradients ``loss.backward()`` computes."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return frozenset(reached)


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
