"""The strategies ``launch(strategy=...)`` knows by name.

One entry per name: where its class is defined and the options the name stands for. A class
is imported when its name is first used, as ``scopedlite/__init__.py`` does for public names:
resolving ``strategy="ddp"`` loads DDP's modules, not DeepSpeed's, FSDP's and XLA's (tens of
milliseconds at every start, on every rank). A strategy whose backend lives in an optional
extra (DeepSpeed, torch_xla) imports it only when such a run starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from scopedlite._strategies.base import Strategy

__all__ = ["STRATEGIES", "Entry", "names_supporting"]


@dataclass(frozen=True)
class Entry:
    """A strategy name's meaning: ``cls(**options)``, the class named by ``where``
    (``"module:Class"``, below ``scopedlite._strategies``)."""

    where: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> type[Strategy]:
        """The class, imported on first use."""
        module, name = self.where.split(":")
        cls: type[Strategy] = getattr(importlib.import_module(f"scopedlite._strategies.{module}"), name)
        return cls

    def is_kind_of(self, strategy: Strategy) -> bool:
        """Whether ``strategy`` is an instance of this entry's class, without importing it: a
        class the instance derives from is loaded already."""
        module, name = self.where.split(":")
        path = f"scopedlite._strategies.{module}"
        return any(c.__module__ == path and c.__qualname__ == name for c in type(strategy).__mro__)

    def __call__(self) -> Strategy:
        return self.cls(**self.options)


_DDP = "ddp.strategy:DDPStrategy"
_FSDP = "fsdp.strategy:FSDPStrategy"
_DEEPSPEED = "deepspeed.strategy:DeepSpeedStrategy"
STRATEGIES: dict[str, Entry] = {
    "single": Entry("single.strategy:SingleDeviceStrategy"),
    "ddp": Entry(_DDP),
    "ddp_fork": Entry(_DDP, {"start_method": "fork"}),
    "ddp_notebook": Entry(_DDP, {"start_method": "fork"}),
    "fsdp": Entry(_FSDP),
    # HSDP as multi-node runs want it: one replica per node, sharded over the node's processes
    "hsdp": Entry(_FSDP, {"replicate_degree": "auto"}),
    # the plan is the user's: by name it runs until lite.setup, which asks for the instance
    "model_parallel": Entry("model_parallel.strategy:ModelParallelStrategy"),
    "deepspeed": Entry(_DEEPSPEED),
    "deepspeed_stage_1": Entry(_DEEPSPEED, {"stage": 1}),
    "deepspeed_stage_2": Entry(_DEEPSPEED, {"stage": 2}),
    "deepspeed_stage_2_offload": Entry(_DEEPSPEED, {"stage": 2, "offload_optimizer": True}),
    "deepspeed_stage_3": Entry(_DEEPSPEED, {"stage": 3}),
    "deepspeed_stage_3_offload": Entry(_DEEPSPEED, {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    "xla": Entry("xla.strategy:XLAStrategy"),
    "xla_single": Entry("xla.strategy:XLASingleDeviceStrategy"),
}


def names_supporting(ability: type) -> list[str]:
    """The names whose strategy class declares ``ability`` (a protocol of ``abilities``),
    found from the classes (which this imports, all of them): nothing is instantiated."""
    return [name for name, entry in STRATEGIES.items() if issubclass(entry.cls, ability)]
