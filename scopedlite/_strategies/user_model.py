"""The set-up model is the user's model: one mechanism, a view class, one hook per backend.

Under every strategy what ``lite.setup`` returns answers the user's attributes and methods and
uses the plain module's state dict keys (SPEC 7-8), whatever the backend made of the module:
DDP and DeepSpeed wrap it (``DistributedDataParallel``, an engine: ``model.scale`` fails there
and the keys carry ``module.``); FSDP2's ``fully_shard`` keeps the user's module, but its
other methods would meet sharded parameters. The mechanism is the same for all three: once
the backend has built the object, its class becomes a subclass of its own class with a *view*
mixed in before it (:func:`present_as_user_model`), as ``fully_shard`` itself swaps the
class. Nothing is written into the instance, and ``isinstance`` against the backend's class
(and the user's, where it held) stays true. The view answers:

- names: a wrapper's view (:class:`UserModelView`) reads the user's attributes from the module
  inside and writes those the module has there; FSDP's module is the user's already;
- the user's own methods (:func:`user_method_names`), through the view's one hook,
  ``_lite_method(method, name)``, handed the plain bound method - ``save_pretrained`` through
  ``_lite_saving_method``. Each backend's hook does what its forward would have done:
  DeepSpeed (deepspeed/methods.py) runs the method inside the engine's forward, always under
  ZeRO-3 (parameters gathered) and otherwise when gradients are on; DDP
  (``SetUpDDP``, ddp/model.py) calls it plainly and prepares DDP's reducer only if
  its result is back-propagated; FSDP (fsdp/methods.py) gathers the parameters when the
  method first needs them. A wrapper's view finds the methods in ``__getattr__`` (they are
  not its class's); a class that is the user's own holds a :class:`UserMethod` for each;
- ``state_dict()`` / ``load_state_dict()``: the user's module's, plain keys.

Which object carries the view: DDP's own module; FSDP's sharded module and each FSDP unit in
it, with a class made for each (holding its gathering state) and swapped back when the run
ends (the module is the user's); under DeepSpeed a second object of the engine's class that
nothing of DeepSpeed references (deepspeed/engines.py), so that a model the user drops is
released - the engine never is garbage (its hooks on the parameters point back at it).
Where a method gathers over several ranks (ZeRO-3, FSDP), the gather ledger (lockstep.py)
checks before the first gather that every rank calls it, and refuses it where one does not;
inside ``lite.join`` it is refused (join/members.py).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from scopedlite._private.torch_internals import has_registered, registered_submodule
from scopedlite._strategies.set_up import SetUpObjects

__all__ = [
    "SAVING_METHODS",
    "UserMethod",
    "UserModelView",
    "present_as_user_model",
    "saving_method",
    "own_class_view",
    "share_tied",
    "user_class_of",
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


def user_class_of(cls: type) -> type:
    """The user's own class ``cls`` is, or subclasses (``GPT`` for FSDP's ``FSDPGPT``)."""
    return next(iter(_user_classes(cls)), cls)


def user_method_names(cls: type[torch.nn.Module]) -> list[str]:
    """The plain methods the user's classes define on ``cls`` (not torch's, not ``forward``,
    not dunders, not torch.nn.Module's API): the ones that must run the way ``forward`` runs."""
    return [
        name
        for name, value in _user_names(cls).items()
        if name not in SAVING_METHODS and callable(value) and not isinstance(value, (staticmethod, classmethod, type))
    ]


@functools.cache
def _user_names(cls: type) -> dict[str, Any]:
    """Every name (methods, properties, class attributes) the user's classes define on ``cls``
    but ``forward``, dunders and torch.nn.Module's API, with its definition the MRO finds."""
    names: dict[str, Any] = {}
    for klass in _user_classes(cls):
        for name, value in vars(klass).items():
            if name != "forward" and name not in _MODULE_API and not (name.startswith("__") and name.endswith("__")):
                names.setdefault(name, value)
    return names


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
    return name in _user_names(type(inner))


class UserModelView(torch.nn.Module):
    """Mixed in before a wrapper class (see the module docstring); never instantiated alone.
    Nothing is stored on the wrapper's instance; each backend's subclass defines its hook,
    :meth:`_lite_method` (``SetUpDDP`` in ddp/model.py, ``EngineView`` in deepspeed/engines.py)."""

    def _lite_inner(self) -> torch.nn.Module | None:
        # Read from __dict__: during unpickling or copying the attribute may not exist yet, and
        # reading it through getattr would come back here forever.
        return registered_submodule(self, "module")

    def _lite_module(self) -> torch.nn.Module:
        """The user's module inside the wrapper, which every built wrapper holds."""
        inner = self._lite_inner()
        assert inner is not None
        return inner

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
        qualified = f"{type(inner).__name__}.{name}"
        if name in SAVING_METHODS:
            return self._lite_saving_method(getattr(inner, name), qualified)
        if name in _methods_of(type(inner)):
            return self._lite_method(getattr(inner, name), qualified)
        return getattr(inner, name)

    def _lite_saving_method(self, method: Callable[..., Any], name: str) -> Any:
        """A method that saves the weights (``save_pretrained``): where every rank holds them
        whole (DDP), the user's own, called directly, on any subset of ranks."""
        return method

    def _lite_method(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        """The backend's hook: ``method`` (one of the user's own, bound to the user's module;
        ``name`` as errors call it, ``"GPT.generate"``) as the set-up model answers it. Here a
        plain call, for a wrapper whose forward prepares nothing a method needs."""
        return method

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
        return self._lite_module().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the plain module (the keys ``state_dict()`` gives)."""
        return self._lite_module().load_state_dict(state_dict, strict=strict, assign=assign)


@functools.cache
def _methods_of(cls: type[torch.nn.Module]) -> frozenset[str]:
    return frozenset(user_method_names(cls))


class UserMethod:
    """One of the user's methods on a view class of an object that *is* the user's module
    (FSDP2's): bound to the object, then answered by the view's hook, ``_lite_method`` (or
    ``_lite_saving_method`` for ``save_pretrained``). A wrapper's view needs none: the user's
    methods are not its class's, and its ``__getattr__`` finds them on the module inside."""

    def __init__(self, function: Any, name: str) -> None:
        self.function = function
        self.name = name  # as errors call it: "GPT.generate"
        self.saving = name.rpartition(".")[2] in SAVING_METHODS

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        bound = self.function.__get__(obj, owner) if hasattr(self.function, "__get__") else self.function
        if obj is None:
            return bound
        return obj._lite_saving_method(bound, self.name) if self.saving else obj._lite_method(bound, self.name)


def own_class_view(own_class: type[torch.nn.Module], mixin: type, **state: Any) -> type[torch.nn.Module]:
    """The view class of one object that is the user's module (of ``own_class``, the user's
    class or FSDP's subclass of it): ``mixin`` (its hooks) before ``own_class``, a
    :class:`UserMethod` for each of the user's methods and for ``save_pretrained``, and
    ``state`` (what the hooks need, as class attributes: the class is made for this object
    and dropped when the run ends)."""
    user = user_class_of(own_class).__name__  # GPT, not FSDP's FSDPGPT
    namespace: dict[str, Any] = {"__module__": mixin.__module__, **state}
    for name in (*user_method_names(own_class), *SAVING_METHODS):
        if callable(function := _user_names(own_class).get(name)):
            namespace[name] = UserMethod(function, f"{user}.{name}")
    return type(own_class.__name__, (mixin, own_class), namespace)


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


def present_as_user_model(
    wrapper: torch.nn.Module, view: type[torch.nn.Module], set_up: SetUpObjects | None = None
) -> torch.nn.Module:
    """Swap ``wrapper``'s class for ``view`` (a subclass of the wrapper's class with a view
    mixed in) once the wrapper is fully built; returns the same object. The class is the one
    change: nothing is written into the instance. With ``set_up`` (the object is the user's
    own module: FSDP2's) the class is swapped back when the run ends."""
    own = type(wrapper)
    if not issubclass(view, own):
        raise TypeError(f"{own.__name__} cannot be presented as {view.__name__}.")
    wrapper.__class__ = view
    if set_up is not None:
        # weakly: the view's class may hold what refers to the object (FSDP's gathering state)
        set_up.at_end(functools.partial(_swap_back, weakref.ref(wrapper), weakref.ref(view), own))
    return wrapper


def _swap_back(obj_ref: weakref.ref[torch.nn.Module], view_ref: weakref.ref[type], own: type) -> None:
    obj = obj_ref()
    if obj is not None and type(obj) is view_ref():
        obj.__class__ = own


@functools.cache
def view_class(wrapper_class: type[torch.nn.Module], mixin: type[UserModelView], name: str) -> type[UserModelView]:
    """The subclass of ``wrapper_class`` with ``mixin`` mixed in, for wrapper classes imported
    only when a run uses them (a DeepSpeed engine); made once per process, as any class is."""
    return type(name, (mixin, wrapper_class), {"__module__": mixin.__module__})  # type: ignore[return-value]
