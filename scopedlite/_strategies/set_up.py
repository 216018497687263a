"""What one run set up: the one registry of the models, optimizers and parameters it handled.

Everything the run must remember about objects that are not ours - the user's modules and
optimizers, torch's ``DistributedDataParallel``, a DeepSpeed engine - lives here, owned by the
run's strategy (a fresh one per launch block), never as attributes written onto those objects:

- the models ``lite.setup`` returned, in setup order (join's hooks run in one order on every
  rank), each with what its strategy keeps about it (DDP: whether it syncs buffers; DeepSpeed:
  its engine's record);
- the optimizers, in setup order;
- the LR schedulers built while the run is active, in the order they were built (a ``lite.join``
  block steps those of its optimizers on the ranks that ran out of data): torch has no hook
  for that, so :meth:`SetUpObjects.watch_schedulers` wraps the schedulers' ``__init__`` for
  the run (``_private/torch_patches.py`` says why and how);
- where each module was set up, so that setting one up twice in a run is refused (two DDP
  reducers on one set of parameters make the ranks hang in their first collective);
- under FSDP, which sharded parameter replaced each parameter an optimizer was built on;
- what the run changed on the user's objects for its duration (an optimizer whose ``step`` the
  strategy takes), undone by :meth:`SetUpObjects.end` when the run ends.

Every reference is weak: a model the user drops is released, and the run keeps nothing alive.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch.optim import lr_scheduler

from scopedlite._private.torch_patches import noting_created

__all__ = ["SetUpObjects"]

# The scheduler classes whose __init__ every torch scheduler passes through: LRScheduler's (its
# subclasses call it), and those of the three that do not call it.
_SCHEDULER_INITS = (
    lr_scheduler.LRScheduler,
    lr_scheduler.SequentialLR,
    lr_scheduler.ChainedScheduler,
    lr_scheduler.ReduceLROnPlateau,
)


class SetUpObjects:
    """The registry of one run (see the module docstring)."""

    def __init__(self) -> None:
        self._models: list[weakref.ref[Any]] = []
        self._records: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._optimizers: list[weakref.ref[Any]] = []
        self._schedulers: list[weakref.ref[Any]] = []
        self._sites: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        # id(parameter before sharding) -> weak refs to it and to the parameter replacing it
        self._successors: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}
        self._at_end: list[Callable[[], None]] = []
        self._watching = contextlib.ExitStack()  # the schedulers' __init__ wrapped for the run
        self._added = 0

    # -- models and optimizers, in setup order -------------------------------------------
    def add_model(self, model: Any, record: Any = None) -> int:
        """Register ``model`` (what ``lite.setup`` returns) with its strategy's ``record``;
        returns its place in setup order (1 for the run's first model)."""
        self._models = [r for r in self._models if r() is not None]
        self._models.append(weakref.ref(model))
        if record is not None:
            self._records[model] = record
        self._added += 1
        return self._added

    def models(self) -> list[Any]:
        """The set-up models still referenced, in setup order."""
        return [m for m in (r() for r in self._models) if m is not None]

    def has_model(self, model: Any) -> bool:
        return any(model is m for m in self.models())

    def record(self, model: Any, default: Any = None) -> Any:
        """What the strategy keeps about the set-up ``model`` (``default`` for anything else)."""
        try:
            return self._records.get(model, default)
        except TypeError:  # not hashable: not a model of ours
            return default

    def parameter_ids(self) -> set[int]:
        """The ids of the parameters the models set up in this run hold."""
        return {id(p) for model in self.models() for p in model.parameters()}

    def add_optimizer(self, optimizer: Any) -> None:
        self._optimizers = [r for r in self._optimizers if r() is not None]
        self._optimizers.append(weakref.ref(optimizer))

    def optimizers(self) -> list[Any]:
        """The set-up optimizers still referenced, in setup order."""
        return [o for o in (r() for r in self._optimizers) if o is not None]

    # -- LR schedulers, in the order they were built ---------------------------------------
    def watch_schedulers(self) -> None:
        """Note every LR scheduler built from now until the run ends (see the module docstring)."""
        self._watching.enter_context(noting_created(_SCHEDULER_INITS, self.add_scheduler))

    def add_scheduler(self, scheduler: Any) -> None:
        """Note ``scheduler`` (built now, or handed to ``lite.join``) after those known."""
        alive = [r for r in self._schedulers if r() is not None]
        if not any(r() is scheduler for r in alive):  # a subclass's __init__ calls its base's
            alive.append(weakref.ref(scheduler))
        self._schedulers = alive

    def schedulers_of(self, optimizers: Iterable[Any]) -> list[Any]:
        """The live LR schedulers built in this run on one of ``optimizers``, in the order they
        were built: the same order on every rank of a script that builds them alike."""
        targets = list(optimizers)
        return [
            s
            for s in (r() for r in self._schedulers)
            if s is not None and any(getattr(s, "optimizer", None) is o for o in targets)
        ]

    # -- where each module was set up ------------------------------------------------------
    def note_site(self, module: Any, site: str) -> None:
        self._sites[module] = site

    def site_of(self, module: Any) -> str | None:
        """Where ``module`` (the user's, or what setup returned) was set up in this run."""
        try:
            return self._sites.get(module)
        except TypeError:
            return None

    # -- parameters replaced by their sharded successors -----------------------------------
    def replace(self, pairs: Iterable[tuple[Any, Any]]) -> None:
        """Note each ``(old, new)``: setting a module up replaced parameter ``old`` by ``new``."""
        self._successors = {k: v for k, v in self._successors.items() if v[0]() is not None and v[1]() is not None}
        for old, new in pairs:
            if old is not new:
                self._successors[id(old)] = (weakref.ref(old), weakref.ref(new))

    def successor(self, old: Any) -> Any:
        """The parameter that replaced ``old`` in a set-up module (None: none did)."""
        entry = self._successors.get(id(old))
        return entry[1]() if entry is not None and entry[0]() is old else None

    # -- the end of the run -----------------------------------------------------------------
    def at_end(self, undo: Callable[[], None]) -> None:
        """Call ``undo`` when the run ends (last registered, first called)."""
        self._at_end.append(undo)

    def end(self) -> None:
        """The run ends: undo what it changed on the user's objects and forget everything.
        Safe to call more than once, and after a failure; every undo runs even if one raises."""
        self._watching.close()
        undos, self._at_end = self._at_end, []
        self._models, self._optimizers, self._schedulers, self._successors = [], [], [], {}
        self._records = weakref.WeakKeyDictionary()
        self._sites = weakref.WeakKeyDictionary()
        error: BaseException | None = None
        for undo in reversed(undos):
            try:
                undo()
            except BaseException as e:  # noqa: BLE001 - raised after the others have run
                error = error or e
        if error is not None:
            raise error

    def is_empty(self) -> bool:
        """Whether the run holds nothing (true once it has ended)."""
        return not (
            self.models()
            or self.optimizers()
            or self._schedulers
            or len(self._sites)
            or self._successors
            or self._at_end
        )


def parameters_outside(optimizer: Any, held: set[int]) -> list[tuple[int, Any]]:
    """``(param group index, parameter)`` of each parameter of ``optimizer`` whose id is not
    in ``held``."""
    return [
        (index, param)
        for index, group in enumerate(optimizer.param_groups)
        for param in group["params"]
        if id(param) not in held
    ]


def foreign_parameter(index: int, param: Any, what: str, why: str = "") -> ValueError:
    """The error for an optimizer's parameter (in param group ``index``) that ``what`` says
    is not the set-up model's; ``why``: what would go wrong under the strategy."""
    return ValueError(
        f"The optimizer's param group {index} holds a parameter of shape {tuple(param.shape)} "
        f"{what}{why}. Set the model up first or together (`model, opt = lite.setup(model, opt)`), "
        "with every trained parameter inside it (`model.scale = torch.nn.Parameter(...)` registers one)."
    )
