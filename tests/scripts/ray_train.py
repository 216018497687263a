"""Ray Train for real: a TorchTrainer with 2 CPU workers runs the unchanged lite loop of
existing_group.py under ddp, fsdp and deepspeed, each in its own launch block, on the gloo
process group Ray made in each worker.

argv: out_dir strategy...   Each worker writes <out_dir>/<strategy>.rank<r>.json; the driver
prints how long Ray took to start and the whole run.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
# Ray's workers are started by the local cluster ray.init makes, with this environment.
os.environ["PYTHONPATH"] = SCRIPTS + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402


def train(config: dict) -> None:
    import torch.distributed as dist

    from existing_group import loop

    assert dist.is_initialized(), "Ray Train made no process group before the train function"
    for strategy in config["strategies"]:
        loop(strategy, config["out"])


if __name__ == "__main__":
    out, strategies = sys.argv[1], sys.argv[2:]
    begin = time.monotonic()
    # A short private folder: Ray's socket paths must stay under the kernel's 107 bytes.
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp)
    started = time.monotonic()
    trainer = TorchTrainer(
        train,
        train_loop_config={"out": out, "strategies": strategies},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=out, name="lite"),
    )
    result = trainer.fit()
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
    print(f"ray: {started - begin:.1f} s to start, {time.monotonic() - begin:.1f} s in all; error: {result.error!r}")
    sys.exit(1 if result.error else 0)
