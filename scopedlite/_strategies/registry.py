"""The strategies ``launch(strategy=...)`` knows by name.

One entry per name: the class and the options the name stands for. A strategy whose backend
lives in an optional extra (DeepSpeed, torch_xla) imports it only when such a run starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from scopedlite._strategies.base import Strategy
from scopedlite._strategies.ddp.strategy import DDPStrategy
from scopedlite._strategies.deepspeed.strategy import DeepSpeedStrategy
from scopedlite._strategies.fsdp.strategy import FSDPStrategy
from scopedlite._strategies.model_parallel.strategy import ModelParallelStrategy
from scopedlite._strategies.single.strategy import SingleDeviceStrategy
from scopedlite._strategies.xla.strategy import XLASingleDeviceStrategy, XLAStrategy

__all__ = ["STRATEGIES", "Entry", "names_supporting"]


@dataclass(frozen=True)
class Entry:
    """A strategy name's meaning: ``cls(**options)``."""

    cls: type[Strategy]
    options: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self) -> Strategy:
        return self.cls(**self.options)


STRATEGIES: dict[str, Entry] = {
    "single": Entry(SingleDeviceStrategy),
    "ddp": Entry(DDPStrategy),
    "ddp_fork": Entry(DDPStrategy, {"start_method": "fork"}),
    "ddp_notebook": Entry(DDPStrategy, {"start_method": "fork"}),
    "fsdp": Entry(FSDPStrategy),
    # HSDP as multi-node runs want it: one replica per node, sharded over the node's processes
    "hsdp": Entry(FSDPStrategy, {"replicate_degree": "auto"}),
    # the plan is the user's: by name it runs until lite.setup, which asks for the instance
    "model_parallel": Entry(ModelParallelStrategy),
    "deepspeed": Entry(DeepSpeedStrategy),
    "deepspeed_stage_1": Entry(DeepSpeedStrategy, {"stage": 1}),
    "deepspeed_stage_2": Entry(DeepSpeedStrategy, {"stage": 2}),
    "deepspeed_stage_2_offload": Entry(DeepSpeedStrategy, {"stage": 2, "offload_optimizer": True}),
    "deepspeed_stage_3": Entry(DeepSpeedStrategy, {"stage": 3}),
    "deepspeed_stage_3_offload": Entry(
        DeepSpeedStrategy, {"stage": 3, "offload_optimizer": True, "offload_parameters": True}
    ),
    "xla": Entry(XLAStrategy),
    "xla_single": Entry(XLASingleDeviceStrategy),
}


def names_supporting(ability: type) -> list[str]:
    """The names whose strategy class declares ``ability`` (a protocol of ``abilities``),
    found from the classes: nothing is instantiated."""
    return [name for name, entry in STRATEGIES.items() if issubclass(entry.cls, ability)]
