"""Setting up modules and optimizers, and the per-step functions that go through the strategy."""

from __future__ import annotations

import math
from typing import Any

import torch

from scopedlite._api.current import current
from scopedlite._api.every_rank import every_rank_calls
from scopedlite._api.join import active_session
from scopedlite._api.loads import load_together
from scopedlite._comm.debug import call_site
from scopedlite._core.structures import map_tensors
from scopedlite._private.torch_internals import compiled_parts, recompile
from scopedlite._strategies.abilities import SupportsJointSetup, SupportsModelBackward

__all__ = ["backward", "clip_gradients", "setup", "setup_module", "setup_optimizers", "to_device"]


def _refuse_second_setup(module: torch.nn.Module) -> None:
    """Setting the same module up twice in one launched run wraps it twice (two DDP reducers
    on one set of parameters), and the ranks then hang in their first collective. Where each
    module was set up is in the run's registry (``_strategies/set_up.py``)."""
    run = current()
    site = run.strategy.set_up.site_of(module) if run.launched else None
    if site is not None:
        raise RuntimeError(
            f"lite.setup got a {type(module).__name__} that was already set up in this run "
            f"(at {site}). Set a model up once per launch block and keep what setup "
            "returned: `model = lite.setup(model)` (or `model, opt = lite.setup(model, opt)`), "
            "then use `model` from there on."
        )


def _every_rank_sets_up() -> None:
    every_rank_calls(
        "lite.setup",
        "the strategy spreads the model over the ranks, or makes their copies equal",
        "Set it up on every rank. A model that one rank uses alone (a plain copy to evaluate "
        "on rank 0) needs no setup: `copy.to(run.device)` and use it as it is.",
    )


def _remember_setup(*modules: torch.nn.Module) -> None:
    run = current()
    if run.launched:
        site = call_site()
        for module in modules:
            run.strategy.set_up.note_site(module, site)


def setup_module(module: torch.nn.Module) -> torch.nn.Module:
    """Move ``module`` to the run's device and precision and wrap it for the strategy
    (``DistributedDataParallel`` under DDP). Returns the module to train with."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"setup_module takes a torch.nn.Module, got {type(module).__name__}.")
    module, compiler = _uncompiled(module)
    _refuse_second_setup(module)
    run = current()
    _every_rank_sets_up()
    # A load on some ranks only is refused (loads.py): checked before the strategy's own hooks
    load_together(module)
    prepared = _cast_inputs(run.strategy.setup_module(module))
    _compile_again(prepared, compiler)
    _remember_setup(module, prepared)
    inner = run.strategy.unwrap(prepared)
    if inner is not module:  # a plan that built another module
        load_together(inner)
    return prepared


def _uncompiled(module: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """``torch.compile(model)`` is set up as ``model``, and compiled again afterwards (see
    :func:`_compile_again`); its state dict then has ``model``'s plain keys."""
    parts = compiled_parts(module)
    return (module, None) if parts is None else parts


def _compile_again(prepared: torch.nn.Module, compiler: Any) -> None:
    """Compile the set-up model in place with the user's ``torch.compile`` options, on the
    part the strategy names: outside DDP's and FSDP's wrapping, as torch advises for them;
    the module inside a DeepSpeed engine, as DeepSpeed's ``engine.compile()`` does."""
    if compiler is not None:
        recompile(current().strategy.compile_target(prepared), compiler)


def _cast_inputs(prepared: torch.nn.Module) -> torch.nn.Module:
    """Cast the inputs of a set-up model to the parameter dtype ("-true" precisions)."""
    precision = current().precision
    if precision.param_dtype is not None:

        def cast_inputs(_: Any, args: Any, kwargs: Any) -> Any:
            return precision.convert_input(args), precision.convert_input(kwargs)

        prepared.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    return prepared


def setup_optimizers(*optimizers: torch.optim.Optimizer) -> Any:
    """Prepare optimizers for the run. Returns one optimizer, or a tuple for several."""
    if not optimizers:
        raise TypeError("setup_optimizers needs at least one optimizer.")
    strategy = current().strategy
    prepared = []
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"setup_optimizers takes torch optimizers, got {type(optimizer).__name__}.")
        prepared.append(strategy.setup_optimizer(optimizer))
    load_together(*optimizers, *prepared)
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


def setup(module: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
    """Set up a model and its optimizers: ``model, opt = lite.setup(model, opt)``.

    Returns the model alone when no optimizer is given, else ``(model, opt1, ...)``.
    """
    strategy = current().strategy
    if optimizers and isinstance(strategy, SupportsJointSetup):
        # Backends that build one object from model and optimizer (a DeepSpeed engine).
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"setup takes a torch.nn.Module, got {type(module).__name__}.")
        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"setup takes torch optimizers, got {type(optimizer).__name__}.")
        module, compiler = _uncompiled(module)
        _refuse_second_setup(module)
        _every_rank_sets_up()
        load_together(module, *optimizers)  # before the strategy's own hooks (loads.py)
        engine, prepared_opts = strategy.setup_module_and_optimizers(module, optimizers)
        _compile_again(engine, compiler)
        _remember_setup(module, engine)
        return (_cast_inputs(engine), *prepared_opts)
    prepared = setup_module(module)
    if not optimizers:
        return prepared
    opts = setup_optimizers(*optimizers)
    return (prepared, *(opts if isinstance(opts, tuple) else (opts,)))


def backward(loss: torch.Tensor, *args: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> None:
    """``loss.backward()`` the way the strategy needs it (loss scaling, engines).

    Args:
        loss: The tensor to backpropagate from.
        *args: Passed on to ``loss.backward`` (not under DeepSpeed, whose engine takes the
            loss only).
        model: The set-up model this loss trains. Only needed under DeepSpeed, where each
            model's engine runs its own backward, and only when the loss depends on several
            models set up with optimizers (a GAN's generator loss); otherwise the engine is
            found from the loss. Other strategies accept and ignore it.
        **kwargs: Passed on to ``loss.backward``.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"lite.backward(loss, model=...) takes the model returned by lite.setup, got {type(model).__name__}."
        )
    strategy = current().strategy
    if isinstance(strategy, SupportsModelBackward):
        strategy.backward_model(loss, model, *args, **kwargs)
    else:
        strategy.backward(loss, *args, **kwargs)


def clip_gradients(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_norm: float | None = None,
    clip_val: float | None = None,
    norm_type: float | str = 2.0,
) -> torch.Tensor | None:
    """Clip gradients by total norm (``max_norm``) or by value (``clip_val``), not both.

    Args:
        module: The set-up model.
        optimizer: The set-up optimizer whose parameters' gradients are clipped.
        max_norm: Scale the gradients so their total ``norm_type``-norm is at most this.
        clip_val: Clamp every gradient element to ``[-clip_val, clip_val]``.
        norm_type: The p of the p-norm for ``max_norm``: a positive number, or
            ``float("inf")`` / ``"inf"`` for the largest absolute value. Default 2.0, as in
            ``torch.nn.utils.clip_grad_norm_``. Under FSDP the norm is of the whole gradient,
            not of this rank's shard.

    Returns:
        The total norm before clipping when clipping by norm, else None.
    """
    if (max_norm is None) == (clip_val is None):
        raise ValueError(
            f"clip_gradients needs exactly one of max_norm or clip_val, got max_norm={max_norm!r}, "
            f"clip_val={clip_val!r}."
        )
    for name, value in (("max_norm", max_norm), ("clip_val", clip_val)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name}={value!r} is not valid: it must be a positive number.")
    p = _norm_type(norm_type)
    if clip_val is not None and p != 2.0:
        raise ValueError(
            f"norm_type={norm_type!r} applies to clipping by norm (max_norm=), but clip_val= "
            "clips each value. Pass max_norm= instead of clip_val=, or leave norm_type out."
        )
    run = current()
    session = active_session(run) if run.world_size > 1 else None
    if run.strategy.clips_together(max_norm is not None) and session is None:
        every_rank_calls("lite.clip_gradients", _CLIPS_TOGETHER, _CLIP_FIX)
    if session is None:
        how = f"clip_val={float(clip_val)}" if clip_val is not None else f"max_norm={float(max_norm)}"  # type: ignore[arg-type]
        run.strategy.note_clip(how if p == 2.0 else f"{how}, norm_type={p}")
    # Inside lite.join the session clips: under sharding, ranks that ran out of data clip too.
    target = session if session is not None else run.strategy
    return target.clip_gradients(module, optimizer, max_norm, clip_val, norm_type=p)


_CLIPS_TOGETHER = "the gradients' norm, or the gradients themselves, come from every rank"
_CLIP_FIX = (
    "Clip on every rank, then use the norm on one: `norm = lite.clip_gradients(model, optimizer, "
    "max_norm=1.0)` everywhere, `if run.is_global_zero: print(norm)`."
)


def _norm_type(norm_type: object) -> float:
    if norm_type == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(
            f"norm_type={norm_type!r} is not valid: pass a positive number (2.0 for the "
            "Euclidean norm, 1.0) or float('inf') / 'inf' for the largest absolute value."
        )
    return float(norm_type)


def to_device(obj: Any) -> Any:
    """Move every tensor in ``obj`` (nested lists/tuples/dicts too) to the run's device."""
    device = current().device
    if isinstance(obj, torch.nn.Module):
        return obj.to(device)
    return map_tensors(obj, lambda t: t.to(device))
