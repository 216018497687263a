"""The public names of scopedlite: this stub is the one list of them.

``scopedlite/__init__.py`` reads it to build ``__all__``, ``__dir__`` and the lazy
``__getattr__``; type checkers and IDEs read it as the package's interface. Add a public
name here, once, as ``from .module import name as name``.
"""

from ._api.autocast import autocast as autocast
from ._api.checkpoint import load as load
from ._api.checkpoint import save as save
from ._api.collectives import all_gather as all_gather
from ._api.collectives import all_reduce as all_reduce
from ._api.collectives import barrier as barrier
from ._api.collectives import broadcast as broadcast
from ._api.collectives import gather_for_metrics as gather_for_metrics
from ._api.current import current as current
from ._api.dataloader import setup_dataloader as setup_dataloader
from ._api.flops import measure_flops as measure_flops
from ._api.join import join as join
from ._api.log import log as log
from ._api.log import log_dict as log_dict
from ._api.peak import peak_flops as peak_flops
from ._api.pretrained import load_pretrained as load_pretrained
from ._api.profiling import profile as profile
from ._api.progress import progress as progress
from ._api.rank_zero import print as print
from ._api.rank_zero import rank_zero_first as rank_zero_first
from ._api.sampler import ShardedBatchSampler as ShardedBatchSampler
from ._api.sampler import ShardedSampler as ShardedSampler
from ._api.seed import seed_everything as seed_everything
from ._api.setup import backward as backward
from ._api.setup import clip_gradients as clip_gradients
from ._api.setup import setup as setup
from ._api.setup import setup_module as setup_module
from ._api.setup import setup_optimizers as setup_optimizers
from ._api.setup import to_device as to_device
from ._api.sharded_init import sharded_init as sharded_init
from ._api.stop import should_stop as should_stop
from ._api.sync import no_backward_sync as no_backward_sync
from ._api.throughput import throughput as throughput
from ._comm.debug import CollectiveMismatchError as CollectiveMismatchError
from ._comm.replicas import ReplicaValuesDifferError as ReplicaValuesDifferError
from ._comm.signature import ShapeMismatchError as ShapeMismatchError
from ._core.run import Run as Run
from ._core.scope import ScopeError as ScopeError
from ._core.scope import carry as carry
from ._hardware.machine import Machine as Machine
from ._io.background import SaveHandle as SaveHandle
from ._io.consolidate import consolidate_checkpoint as consolidate_checkpoint
from ._io.files import CheckpointError as CheckpointError
from ._launch.scope import launch as launch
from ._launch.stacks import CollectiveTimeoutError as CollectiveTimeoutError
from ._launch.supervise import RankFailure as RankFailure
from ._launch.supervise import WorkerFailedError as WorkerFailedError
from ._loggers.base import Logger as Logger
from ._loggers.csv import CSVLogger as CSVLogger
from ._loggers.mlflow import MLFlowLogger as MLFlowLogger
from ._loggers.tensorboard import TensorBoardLogger as TensorBoardLogger
from ._loggers.wandb import WandbLogger as WandbLogger
from ._plan import Plan as Plan
from ._plan import resolve as resolve
from ._strategies.base import Strategy as Strategy
from ._strategies.ddp.strategy import DDPStrategy as DDPStrategy
from ._strategies.deepspeed.checkpoint import (
    consolidate_deepspeed_checkpoint as consolidate_deepspeed_checkpoint,
)
from ._strategies.deepspeed.strategy import DeepSpeedStrategy as DeepSpeedStrategy
from ._strategies.fsdp.strategy import FSDPStrategy as FSDPStrategy
from ._strategies.join.collectives import PeerLeftJoinError as PeerLeftJoinError
from ._strategies.lockstep import CollectiveOnSomeRanksError as CollectiveOnSomeRanksError
from ._strategies.lockstep import ForwardOnSomeRanksError as ForwardOnSomeRanksError
from ._strategies.lockstep import MethodCalledOnSomeRanksError as MethodCalledOnSomeRanksError
from ._strategies.model_parallel.strategy import ModelParallelStrategy as ModelParallelStrategy
from ._strategies.single.strategy import SingleDeviceStrategy as SingleDeviceStrategy
from ._strategies.xla.strategy import XLAStrategy as XLAStrategy

__version__: str
