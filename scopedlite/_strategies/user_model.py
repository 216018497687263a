"""The set-up model stays the user's model: a wrapper that answers for the module inside.

DDP and DeepSpeed return a wrapper (``DistributedDataParallel``, a DeepSpeed engine) whose
attributes, methods and state dict keys are the wrapper's own: ``model.scale`` fails and
``model.state_dict()`` has ``module.``-prefixed keys that do not load into a plain ``Net()``.
A script written for one device must not change when the strategy does, so the wrapper's
class is swapped, after it is built, for a subclass that adds :class:`UserModelView`:

- attributes the wrapper does not have are read from (and, if the module has them, written
  to) the user's module;
- the user's own methods: under DDP plain calls, with DDP's gradient sync prepared only when
  their result is back-propagated (ddp/methods.py); under DeepSpeed *through the engine's
  forward* (the user's ``forward`` is pointed at the method for that one call), so that
  ZeRO-3 gathers the parameters for them;
- ``state_dict()`` / ``load_state_dict()`` are the user's module's, with its plain keys.

The wrapper keeps its class's identity (``isinstance(model, DistributedDataParallel)`` stays
true), so code that checks for it keeps working. Swapping the class of an object built by a
library, rather than wrapping it again, is what FSDP2's ``fully_shard`` does too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from scopedlite._private.torch_internals import ddp_comm_hook, has_registered, registered_submodule
from scopedlite._strategies.ddp.counted import count_of, paused_in_torch_join, use_hook
from scopedlite._strategies.ddp.methods import ddp_method
from scopedlite._strategies.ddp.unused import forward_naming_unused
from scopedlite._strategies.join.members import in_join, refuse_backward_in_join, refuse_gather_in_join
from scopedlite._strategies.lockstep import Nesting, every_rank_calls
from scopedlite._strategies.method_results import on_backward

__all__ = [
    "SAVING_METHODS",
    "SetUpDDP",
    "UserModelView",
    "present_as_user_model",
    "saving_method",
    "share_tied",
    "user_method_names",
    "user_owns",
    "view_class",
]

# Classes defined in these packages are the wrappers' and torch's, not the user's.
_LIBRARY_PREFIXES = ("torch.", "deepspeed.", "scopedlite.")
# torch.nn.Module's own API (train, to, parameters, ...): the wrapper's, which applies it to the
# user's module too, even where the user's class overrides it (Hugging Face overrides `to`,
# `train`, `half`, ...); and the attributes every module instance carries.
_MODULE_API = frozenset(dir(torch.nn.Module)) | frozenset(vars(torch.nn.Module()))
# Methods that save the model's weights: they read parameters and run no forward.
SAVING_METHODS = frozenset({"save_pretrained"})


def _user_classes(cls: type) -> list[type]:
    return [
        klass
        for klass in cls.__mro__
        if klass is not object and not klass.__module__.startswith(_LIBRARY_PREFIXES) and klass.__module__ != "torch"
    ]


def user_method_names(cls: type[torch.nn.Module]) -> list[str]:
    """The plain methods the user's classes define on ``cls`` (not torch's, not ``forward``,
    not dunders, not torch.nn.Module's API): the ones that must run the way ``forward`` runs."""
    names: dict[str, None] = {}
    for klass in _user_classes(cls):
        for name, value in vars(klass).items():
            if (
                name == "forward"
                or name in _MODULE_API
                or name in SAVING_METHODS
                or (name.startswith("__") and name.endswith("__"))
            ):
                continue
            if callable(value) and not isinstance(value, (staticmethod, classmethod, type)):
                names.setdefault(name, None)
    return list(names)


@functools.cache
def _class_names(cls: type) -> frozenset[str]:
    """Every name (methods, properties, class attributes) the user's classes define on ``cls``."""
    return frozenset(
        name
        for klass in _user_classes(cls)
        for name in vars(klass)
        if name != "forward" and name not in _MODULE_API and not (name.startswith("__") and name.endswith("__"))
    )


def user_owns(inner: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is the user's own on ``inner``: an attribute its ``__init__`` set, one of
    its own parameters, buffers or submodules, or anything its (non-torch) classes define."""
    if name.startswith("__") and name.endswith("__"):
        return False
    own = inner.__dict__
    if name in own:
        return name not in _MODULE_API
    if has_registered(inner, name):
        return True
    return name in _class_names(type(inner))


class UserModelView(torch.nn.Module):
    """Mixed in before a wrapper class (see the module docstring); never instantiated alone.

    Nothing is stored on the wrapper's instance: what differs between wrappers is answered by
    the view's class (:attr:`lite_always_through_forward`, :meth:`_lite_nesting`).

    Attributes:
        lite_always_through_forward: Run the user's methods through the wrapper's forward
            even with gradients disabled (ZeRO-3: parameters must be gathered for any use).
            Otherwise they go through forward only when gradients are enabled (DeepSpeed
            stages 1-2; :class:`SetUpDDP` routes them its own way).
    """

    lite_always_through_forward: ClassVar[bool] = False

    def _lite_nesting(self) -> Nesting | None:
        """Where methods gather over several ranks (ZeRO-3): the model's
        :class:`~scopedlite._strategies.lockstep.Nesting`, whose ledger checks that every rank
        calls the method before it gathers; None elsewhere. Inside ``lite.join`` a method that
        would gather is refused, and one whose result is back-propagated too (join/members.py)."""
        return None

    def _lite_inner(self) -> torch.nn.Module | None:
        # Read from __dict__: during unpickling or copying the attribute may not exist yet, and
        # reading it through getattr would come back here forever.
        return registered_submodule(self, "module")

    def __getattr__(self, name: str) -> Any:
        try:  # the wrapper's own parameters, buffers and submodules ("module")
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        inner = self._lite_inner()
        if inner is None or not hasattr(inner, name):
            raise AttributeError(
                f"'{type(self).__name__}' object (the model returned by lite.setup) has no "
                f"attribute {name!r}, and neither has the {type(inner).__name__} inside it."
            )
        return self._lite_user_attribute(inner, name)

    def _lite_user_attribute(self, inner: torch.nn.Module, name: str) -> Any:
        """``inner``'s attribute ``name`` as the set-up model answers it."""
        if name in SAVING_METHODS:
            return self._lite_saving_method(inner, name)
        if name in _methods_of(type(inner)):
            return self._lite_method(inner, name)
        return getattr(inner, name)

    def _lite_saving_method(self, inner: torch.nn.Module, name: str) -> Any:
        """A method that saves the weights (``save_pretrained``): where every rank holds them
        whole (DDP), the user's own, called directly, on any subset of ranks."""
        return getattr(inner, name)

    def _lite_method(self, inner: torch.nn.Module, name: str) -> Callable[..., Any]:
        """``inner.<name>``, one of the user's own methods, as the set-up model answers it."""
        return _through_forward(self, inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self._lite_inner()
        if inner is not None and not self._lite_has_own(name) and hasattr(inner, name):
            setattr(inner, name, value)  # e.g. ``model.scale = 2.0`` changes what forward reads
            return
        super().__setattr__(name, value)

    def _lite_has_own(self, name: str) -> bool:
        if name in self.__dict__ or hasattr(type(self), name):
            return True
        return has_registered(self, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self._lite_inner())))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The user's module's state dict: the keys of the plain module (no ``module.``)."""
        return self._lite_inner().state_dict(*args, **kwargs)  # type: ignore[union-attr]

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the plain module (the keys ``state_dict()`` gives)."""
        return self._lite_inner().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[union-attr]


@functools.cache
def _methods_of(cls: type[torch.nn.Module]) -> frozenset[str]:
    return frozenset(user_method_names(cls))


def _through_forward(wrapper: UserModelView, inner: torch.nn.Module, name: str) -> Callable[..., Any]:
    """``inner.<name>`` as a callable that runs inside ``wrapper``'s forward when needed."""
    method = getattr(inner, name)
    qualified = f"{type(inner).__name__}.{name}"

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if in_join(inner):  # ranks out of data replay forwards: a method is not one (join/members.py)
            if wrapper.lite_always_through_forward:
                refuse_gather_in_join(qualified)
            return on_backward(method(*args, **kwargs), functools.partial(refuse_backward_in_join, qualified))
        if not (wrapper.lite_always_through_forward or torch.is_grad_enabled()):
            return method(*args, **kwargs)
        with every_rank_calls(wrapper._lite_nesting(), qualified):  # ZeRO-3 over several ranks
            return _run_through_forward(wrapper, inner, method, args, kwargs)

    return call


def _not_traced(method: Callable[..., Any]) -> Callable[..., Any]:
    """A compiled wrapper (``torch.compile``) traces its forward: not the user's method run in
    its place. (Nothing is compiled while torch's compiler was never imported.)"""
    return torch.compiler.disable(method) if "torch._dynamo" in sys.modules else method


# Set while one of the user's methods runs inside the wrapper's forward: a backend that counts
# the user's training forwards (deepspeed/counted.py) does not count that call.
_METHOD_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("scopedlite_method_running", default=False)


def method_running() -> bool:
    """Whether the wrapper's forward under way runs one of the user's methods, not forward."""
    return _METHOD_RUNNING.get()


def _run_through_forward(
    wrapper: UserModelView, inner: torch.nn.Module, method: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Call ``method`` inside ``wrapper``'s forward (``inner.forward`` points at it meanwhile)."""
    had_own_forward = "forward" in inner.__dict__
    own_forward = inner.__dict__.get("forward")

    def redirected(*a: Any, **k: Any) -> Any:
        _restore_forward(inner, had_own_forward, own_forward)  # the method may call forward
        out = method(*a, **k)
        # Wrappers' post-forward hooks look into outputs; a plain str or float has no
        # attributes to look into (ZeRO-3 calls vars() on it), so it travels boxed.
        return (
            out
            if out is None or isinstance(out, (torch.Tensor, list, tuple, dict)) or hasattr(out, "__dict__")
            else _Boxed(out)
        )

    inner.forward = _not_traced(redirected)  # type: ignore[method-assign]
    token = _METHOD_RUNNING.set(True)
    try:
        out = wrapper(*args, **kwargs)
    finally:
        _METHOD_RUNNING.reset(token)
        _restore_forward(inner, had_own_forward, own_forward)
    return out.value if isinstance(out, _Boxed) else out


class _Boxed:
    """A method's result that is neither a tensor nor a container, through a wrapper's forward."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _restore_forward(inner: torch.nn.Module, had_own: bool, own: Any) -> None:
    if had_own:
        inner.forward = own  # type: ignore[method-assign]
    else:
        inner.__dict__.pop("forward", None)


def saving_method(
    method: Callable[..., Any],
    full_state: Callable[[], dict[str, Any]],
    together: Callable[[], contextlib.AbstractContextManager[None]],
) -> Callable[..., Any]:
    """``method`` (``save_pretrained``) of a model whose weights are sharded: every rank calls
    it, ``full_state()`` gathers the plain model's full state dict to rank 0, rank 0 writes it
    (``state_dict=``, unless the caller passes one), and the other ranks wait until it has.
    ``together()`` checks first that every rank calls it (``lockstep.gathering_together``): a
    call on rank 0 alone is refused there instead of waiting in the gather for ever."""

    @functools.wraps(method)
    def save(*args: Any, **kwargs: Any) -> Any:
        with together():
            state = full_state()
        result = None
        if torch.distributed.get_rank() == 0:
            kwargs.setdefault("state_dict", state)
            result = method(*args, **kwargs)
        torch.distributed.barrier()
        return result

    return save


def share_tied(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Make the names of one tied parameter hold one tensor in ``state``, as they do in the
    plain module's state dict (savers drop the duplicates by storage)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for group in names.values():
        present = [n for n in group if n in state]
        for name in present[1:]:
            state[name] = state[present[0]]
    return state


class SetUpDDP(UserModelView, DistributedDataParallel):
    """``DistributedDataParallel`` answering for the user's module (see the module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """DDP's forward; its error for parameters the last backward left without a
        gradient names them and our fixing line (ddp/unused.py). A training forward is
        counted, for the ranks to compare at the next backward (ddp/counted.py)."""
        if torch.is_grad_enabled():
            count = count_of(ddp_comm_hook(self))
            if count is not None:
                count.forward()
        return forward_naming_unused(self, *args, **kwargs)

    def _lite_method(self, inner: torch.nn.Module, name: str) -> Callable[..., Any]:
        return ddp_method(self, inner, name)

    def join_hook(self, **kwargs: Any) -> Any:
        """torch's ``Join([model])``: DDP's own hook, with the ranks' comparison of their
        training forwards paused for the block (ddp/counted.py), where a rank out of data
        shadows the others' backwards after fewer forwards."""
        return paused_in_torch_join(super().join_hook(**kwargs), self)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Your hook reduces the gradient buckets; inside the set-up model's own hook, which
        still has the ranks compare their backwards (ddp/counted.py)."""
        if not use_hook(ddp_comm_hook(self), state, hook):
            super().register_comm_hook(state, hook)


def present_as_user_model(wrapper: torch.nn.Module, view: type[UserModelView]) -> torch.nn.Module:
    """Swap ``wrapper``'s class for ``view`` (a subclass of :class:`UserModelView` and of the
    wrapper's class) once the wrapper is fully built; returns the same object. The class is
    the one change: nothing is written into the instance."""
    if not issubclass(view, type(wrapper)):
        raise TypeError(f"{type(wrapper).__name__} cannot be presented as {view.__name__}.")
    wrapper.__class__ = view
    return wrapper


@functools.cache
def view_class(wrapper_class: type[torch.nn.Module], mixin: type[UserModelView], name: str) -> type[UserModelView]:
    """The subclass of ``wrapper_class`` with ``mixin`` mixed in, for wrapper classes imported
    only when a run uses them (a DeepSpeed engine); made once per process, as any class is."""
    return type(name, (mixin, wrapper_class), {"__module__": mixin.__module__})  # type: ignore[return-value]
