"""The strategies ``launch(strategy=...)`` knows by name.

One entry per name. A strategy living in an optional extra is imported only when chosen.
"""

from __future__ import annotations

from typing import Callable

from scopedlite._strategies._base import Strategy
from scopedlite._strategies._ddp import DDPStrategy
from scopedlite._strategies._single import SingleDeviceStrategy

__all__ = ["STRATEGIES", "DDPStrategy", "SingleDeviceStrategy", "Strategy", "strategy_from_name"]

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "ddp_fork": lambda: DDPStrategy(start_method="fork"),
    "ddp_notebook": lambda: DDPStrategy(start_method="fork"),
}


def strategy_from_name(name: str) -> Strategy:
    return STRATEGIES[name]()
