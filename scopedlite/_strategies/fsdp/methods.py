"""The user's own methods of a sharded model gather its parameters when they need them.

FSDP2 all-gathers a unit's parameters in a hook around ``forward`` only; any other method of
the model (``model.features(x)``, ``model.generate(...)``) would meet sharded ``DTensor``
parameters ("got mixed torch.Tensor and DTensor"). Each method the user's classes define is
therefore run with FSDP's pre- and post-forward around it (gather, then reshard with the
backward hooks set on its outputs) - but only once it *needs* the parameters whole:

- when it runs a module of the model's own parameter group (``self.head(x)``, ``self(x)``);
  a module that is its own FSDP unit gathers itself, as in forward;
- at once when the model's class holds parameters of its own (``self.scale``, not in a
  submodule), which a method can use without running any module.

Until then it is a plain call, so a method that reads only what sharded parameters tell
without gathering - ``p.numel()`` and ``p.shape`` are the full sizes - or the config works on
any ranks: nanoGPT's ``estimate_mfu`` on rank 0. A method that gathers is a collective, like
forward: just before its first gather it is checked against the other ranks (lockstep.py)
and refused, naming them, where they do not call it; inside ``lite.join`` it is refused (ranks
out of data replay forwards, not methods: join/members.py).

A method called while the model is already gathered (from ``forward``, or from another of
its methods) runs as it is: a second post-forward would reshard the parameters under the
outer call's feet. A depth count, kept by hooks around ``forward`` and by the methods
themselves, tells the cases apart; the same hook notes each outermost forward of the model in
the ledger.

``save_pretrained`` (a Hugging Face model's) is not gathered like the others: every rank calls
it, the full state dict is gathered to rank 0 (``get_model_state_dict``), and rank 0 alone runs
the method with it, the methods it calls running plainly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from scopedlite._private.torch_internals import (
    fsdp_cast_forward_inputs,
    fsdp_post_forward,
    fsdp_pre_forward,
    fsdp_subclass_namespace,
)
from scopedlite._strategies.join.members import in_join, refuse_gather_in_join
from scopedlite._strategies.lockstep import GatherLedger, Nesting, gathering_together
from scopedlite._strategies.set_up import SetUpObjects
from scopedlite._strategies.user_model import (
    own_class_view,
    present_as_user_model,
    saving_method,
    share_tied,
)

__all__ = ["GatheringView", "count_depth", "gather_for_user_methods"]


def gather_for_user_methods(root: torch.nn.Module, ledger: GatherLedger | None, set_up: SetUpObjects) -> None:
    """Make the methods the user's classes define gather when they need to, on the sharded
    ``root`` and on each submodule that is its own FSDP unit; the root's
    outermost forwards are noted in ``ledger`` (None: one rank, nothing to check). Each such
    module is presented as the user's model (``user_model.present_as_user_model``: its class
    becomes one with :class:`GatheringView` mixed in) until the run ends (``set_up``).

    Methods of a submodule that is not its own FSDP unit are not covered when called from
    outside (``model.encoder.encode(x)``): call them from a method of the model, or make the
    submodule a unit (``auto_wrap_policy``)."""
    from torch.distributed.fsdp import FSDPModule  # lazy: ~0.9 s to import

    nestings = {id(root): count_depth(root, Nesting(ledger), set_up)}
    units = [sub for sub in root.modules() if sub is not root and isinstance(sub, FSDPModule)]
    for unit in units:
        nestings[id(unit)] = count_depth(unit, Nesting(None), set_up)
    for module in (*units, root):
        gathering = _Gathering(module, root, nestings, ledger)
        # the view's class and GatheringView come before FSDP's class in the MRO
        state = {"_lite_gathering": gathering, **fsdp_subclass_namespace(type(module), mixins=2)}
        view = own_class_view(type(module), GatheringView, **state)
        present_as_user_model(module, view, set_up)


class GatheringView(torch.nn.Module):
    """Mixed in before FSDP's class of a sharded module, which *is* the user's module (its
    attributes and state dict are the user's already): its hooks answer the user's methods
    (``user_model.own_class_view``). The class made for one module holds that module's
    :class:`_Gathering`; nothing is written into the instance."""

    _lite_gathering: ClassVar[_Gathering]

    def _lite_method(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        gathering = type(self)._lite_gathering
        return gathering.method(method, name) if gathering.module is self else method

    def _lite_saving_method(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        gathering = type(self)._lite_gathering
        if gathering.module is not self or self is not gathering.root:
            return method
        return saving_method(
            _as_gathered(method, gathering.nesting),
            functools.partial(_full_state, self),
            functools.partial(gathering_together, gathering.nesting, self, name),
        )


def _as_gathered(method: Callable[..., Any], nesting: Nesting) -> Callable[..., Any]:
    """``method`` run as if the parameters were gathered: the methods it calls run plainly
    (``save_pretrained`` runs on rank 0 alone and reads the gathered state dict it is given)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with nesting.method():
            return method(*args, **kwargs)

    return call


def _full_state(module: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return share_tied(module, state) if state else state


def count_depth(module: torch.nn.Module, nesting: Nesting, set_up: SetUpObjects) -> Nesting:
    """Count ``module``'s forwards in ``nesting`` until the run ends."""
    # prepend: counted (and noted in the ledger) before FSDP's own pre-forward hook gathers,
    # and a failing gather still leaves through the always_call post hook that uncounts it.
    set_up.at_end(module.register_forward_pre_hook(nesting.enter, prepend=True).remove)
    set_up.at_end(module.register_forward_hook(nesting.leave, always_call=True).remove)
    return nesting


class _Gathering:
    """One sharded module (the root or a unit): its user methods' lazy gathering."""

    def __init__(
        self,
        module: torch.nn.Module,
        root: torch.nn.Module,
        nestings: dict[int, Nesting],
        ledger: GatherLedger | None,
    ) -> None:
        self.module = module
        self.root = root
        self.nestings = nestings  # of the root and each unit, by id
        self.nesting = nestings[id(module)]
        self.root_nesting = nestings[id(root)]
        self.ledger = ledger
        # parameters of the module's own (not in a submodule) a method can use without a module
        self.eager = any(True for _ in module.parameters(recurse=False))
        self._owners: dict[int, torch.nn.Module] | None = None

    @property
    def owners(self) -> dict[int, torch.nn.Module]:
        """id(module) -> the FSDP module whose parameter group holds its parameters."""
        if self._owners is None:
            from torch.distributed.fsdp import FSDPModule

            owners = {id(self.module): self.module}
            stack = [(self.module, self.module)]
            while stack:
                parent, owner = stack.pop()
                for child in parent.children():
                    if id(child) not in owners:
                        owners[id(child)] = child if isinstance(child, FSDPModule) else owner
                        stack.append((child, owners[id(child)]))
            self._owners = owners
        return self._owners

    def method(self, plain: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(plain)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.nesting.depth:
                return plain(*args, **kwargs)
            args, kwargs = fsdp_cast_forward_inputs(self.module, args, kwargs)
            # A unit's method called inside the root's forward (or one of its methods) is part
            # of that step, which every rank takes: only an outermost call is checked.
            lazy = _LazyGather(self, name, self.ledger, outermost=self.root_nesting.depth == 0)
            with self.nesting.method(), lazy.watching():
                if self.eager:
                    lazy.gather_own()
                out = plain(*args, **kwargs)
            return lazy.finish(out)

        return call


class _LazyGather:
    """One call of a user method: gathers the module's own group when first needed."""

    def __init__(self, gathering: _Gathering, name: str, ledger: GatherLedger | None, outermost: bool) -> None:
        self.gathering = gathering
        self.name = name
        self.ledger = ledger
        self.checked = not outermost
        self.gathered = False
        self._handle: Any = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        # A global hook: it runs before the modules' own hooks (FSDP's gathers), and only
        # for this call (removed once the module's own group is gathered).
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._module_called)
        try:
            yield
        finally:
            self._stop_watching()

    def _stop_watching(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _module_called(self, module: torch.nn.Module, _: Any) -> None:
        owner = self.gathering.owners.get(id(module))
        if owner is None:
            return  # not ours
        try:
            self.check()
        except BaseException:
            # torch still runs the module's always_call forward hooks after a pre-hook raised:
            # the one that uncounts a forward that, here, never started.
            nesting = self.gathering.nestings.get(id(module))
            if nesting is not None:
                nesting.depth += 1
            raise
        if owner is self.gathering.module and module is not owner:
            self.gather_own()  # the module itself, or a unit, is gathered by FSDP's own hooks

    def check(self) -> None:
        """Refuse, before the first gather, what the other ranks cannot take part in."""
        if self.checked:
            return
        self.checked = True
        if in_join(self.gathering.root):
            refuse_gather_in_join(self.name)
        if self.ledger is not None:
            self.ledger.method(self.name)

    def gather_own(self) -> None:
        if self.gathered:
            return
        self.check()
        fsdp_pre_forward(self.gathering.module)
        self.gathered = True
        self._stop_watching()

    def finish(self, out: Any) -> Any:
        return fsdp_post_forward(self.gathering.module, out) if self.gathered else out
