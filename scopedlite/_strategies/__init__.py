"""The strategies ``launch(strategy=...)`` knows by name.

One entry per name. A strategy living in an optional extra is imported only when chosen.
"""

from __future__ import annotations

from typing import Callable

from scopedlite._strategies._base import Strategy
from scopedlite._strategies._ddp import DDPStrategy
from scopedlite._strategies._fsdp import FSDPStrategy
from scopedlite._strategies._deepspeed import DeepSpeedStrategy, consolidate_deepspeed_checkpoint
from scopedlite._strategies._single import SingleDeviceStrategy
from scopedlite._strategies._xla import XLASingleDeviceStrategy, XLAStrategy

__all__ = [
    "STRATEGIES",
    "DDPStrategy",
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "XLASingleDeviceStrategy",
    "XLAStrategy",
    "consolidate_deepspeed_checkpoint",
    "strategy_from_name",
]

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "ddp_fork": lambda: DDPStrategy(start_method="fork"),
    "ddp_notebook": lambda: DDPStrategy(start_method="fork"),
    "fsdp": FSDPStrategy,
    # DeepSpeed itself is imported only when such a run starts.
    "deepspeed": DeepSpeedStrategy,
    "deepspeed_stage_1": lambda: DeepSpeedStrategy(stage=1),
    "deepspeed_stage_2": lambda: DeepSpeedStrategy(stage=2),
    "deepspeed_stage_2_offload": lambda: DeepSpeedStrategy(stage=2, offload_optimizer=True),
    "deepspeed_stage_3": lambda: DeepSpeedStrategy(stage=3),
    "deepspeed_stage_3_offload": lambda: DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True),
    # torch_xla is imported only when such a run starts (extra scopedlite[xla]).
    "xla": XLAStrategy,
    "xla_single": XLASingleDeviceStrategy,
}


def strategy_from_name(name: str) -> Strategy:
    return STRATEGIES[name]()
