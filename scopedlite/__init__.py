"""scopedlite: scale an unchanged PyTorch training loop by wrapping it in scopes.

Every public name is re-exported here once; the modules behind them are private. They are
imported on first use (PEP 562), so ``import scopedlite`` costs next to nothing beyond torch.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

try:  # where the program started: a re-executed worker starts there (scopedlite._launchers._start)
    _START_DIRECTORY: str | None = _os.getcwd()
except OSError:
    _START_DIRECTORY = None

# public name -> private module that defines it
_EXPORTS: dict[str, str] = {
    "autocast": "scopedlite._autocast",
    "CheckpointError": "scopedlite._checkpoint",
    "CollectiveMismatchError": "scopedlite._debug",
    "CollectiveTimeoutError": "scopedlite._stacks",
    "should_stop": "scopedlite._stop",
    "load": "scopedlite._checkpoint",
    "save": "scopedlite._checkpoint",
    "all_gather": "scopedlite._collectives",
    "all_reduce": "scopedlite._collectives",
    "barrier": "scopedlite._collectives",
    "broadcast": "scopedlite._collectives",
    "setup_dataloader": "scopedlite._dataloader",
    "join": "scopedlite._join",
    "launch": "scopedlite._launch",
    "RankFailure": "scopedlite._launchers._supervise",
    "WorkerFailedError": "scopedlite._launchers._supervise",
    "Machine": "scopedlite._plan",
    "Plan": "scopedlite._plan",
    "progress": "scopedlite._progress",
    "resolve": "scopedlite._plan",
    "print": "scopedlite._rank_zero",
    "rank_zero_first": "scopedlite._rank_zero",
    "Run": "scopedlite._run",
    "current": "scopedlite._run",
    "ShardedBatchSampler": "scopedlite._sampler",
    "ShardedSampler": "scopedlite._sampler",
    "ScopeError": "scopedlite._scope",
    "carry": "scopedlite._scope",
    "seed_everything": "scopedlite._seed",
    "backward": "scopedlite._setup",
    "clip_gradients": "scopedlite._setup",
    "setup": "scopedlite._setup",
    "setup_module": "scopedlite._setup",
    "setup_optimizers": "scopedlite._setup",
    "to_device": "scopedlite._setup",
    "sharded_init": "scopedlite._sharded_init",
    "DDPStrategy": "scopedlite._strategies",
    "FSDPStrategy": "scopedlite._strategies",
    "consolidate_checkpoint": "scopedlite._consolidate",
    "DeepSpeedStrategy": "scopedlite._strategies",
    "consolidate_deepspeed_checkpoint": "scopedlite._strategies",
    "SingleDeviceStrategy": "scopedlite._strategies",
    "Strategy": "scopedlite._strategies",
    "XLAStrategy": "scopedlite._strategies",
    "no_backward_sync": "scopedlite._sync",
}

if TYPE_CHECKING:
    from scopedlite._autocast import autocast as autocast
    from scopedlite._checkpoint import CheckpointError as CheckpointError
    from scopedlite._debug import CollectiveMismatchError as CollectiveMismatchError
    from scopedlite._stacks import CollectiveTimeoutError as CollectiveTimeoutError
    from scopedlite._stop import should_stop as should_stop
    from scopedlite._checkpoint import load as load
    from scopedlite._checkpoint import save as save
    from scopedlite._collectives import all_gather as all_gather
    from scopedlite._collectives import all_reduce as all_reduce
    from scopedlite._collectives import barrier as barrier
    from scopedlite._collectives import broadcast as broadcast
    from scopedlite._dataloader import setup_dataloader as setup_dataloader
    from scopedlite._join import join as join
    from scopedlite._launch import launch as launch
    from scopedlite._launchers._supervise import RankFailure as RankFailure
    from scopedlite._launchers._supervise import WorkerFailedError as WorkerFailedError
    from scopedlite._plan import Machine as Machine
    from scopedlite._plan import Plan as Plan
    from scopedlite._plan import resolve as resolve
    from scopedlite._progress import progress as progress
    from scopedlite._rank_zero import print as print
    from scopedlite._rank_zero import rank_zero_first as rank_zero_first
    from scopedlite._run import Run as Run
    from scopedlite._run import current as current
    from scopedlite._sampler import ShardedBatchSampler as ShardedBatchSampler
    from scopedlite._sampler import ShardedSampler as ShardedSampler
    from scopedlite._scope import ScopeError as ScopeError
    from scopedlite._scope import carry as carry
    from scopedlite._seed import seed_everything as seed_everything
    from scopedlite._setup import backward as backward
    from scopedlite._setup import clip_gradients as clip_gradients
    from scopedlite._setup import setup as setup
    from scopedlite._setup import setup_module as setup_module
    from scopedlite._setup import setup_optimizers as setup_optimizers
    from scopedlite._setup import to_device as to_device
    from scopedlite._sharded_init import sharded_init as sharded_init
    from scopedlite._strategies import DDPStrategy as DDPStrategy
    from scopedlite._strategies import FSDPStrategy as FSDPStrategy
    from scopedlite._consolidate import consolidate_checkpoint as consolidate_checkpoint
    from scopedlite._strategies import DeepSpeedStrategy as DeepSpeedStrategy
    from scopedlite._strategies import consolidate_deepspeed_checkpoint as consolidate_deepspeed_checkpoint
    from scopedlite._strategies import SingleDeviceStrategy as SingleDeviceStrategy
    from scopedlite._strategies import Strategy as Strategy
    from scopedlite._strategies import XLAStrategy as XLAStrategy
    from scopedlite._sync import no_backward_sync as no_backward_sync


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scopedlite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DDPStrategy",
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "Machine",
    "Plan",
    "RankFailure",
    "Run",
    "ScopeError",
    "ShardedBatchSampler",
    "ShardedSampler",
    "SingleDeviceStrategy",
    "Strategy",
    "WorkerFailedError",
    "XLAStrategy",
    "all_gather",
    "all_reduce",
    "autocast",
    "backward",
    "barrier",
    "broadcast",
    "carry",
    "clip_gradients",
    "consolidate_checkpoint",
    "consolidate_deepspeed_checkpoint",
    "current",
    "join",
    "launch",
    "load",
    "no_backward_sync",
    "print",
    "progress",
    "rank_zero_first",
    "resolve",
    "save",
    "seed_everything",
    "setup",
    "setup_dataloader",
    "setup_module",
    "setup_optimizers",
    "should_stop",
    "sharded_init",
    "to_device",
]
