"""The torch range scopedlite states is the one it is tested with.

pyproject.toml's floor, README's tested range and the torch that .ci/run installs for the floor
smoke run must agree, and that floor is what the fsdp strategy needs: on an older torch it
refuses, naming the version. (The refusal was seen for real with torch 2.5.1; here the current
torch must pass the check, and torch 2.5's torch.distributed.fsdp, which exports the FSDP1 names
only, and torch 2.7 must not.)
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import torch
import torch.distributed.fsdp

from scopedlite._strategies.fsdp.strategy import FSDP2_TORCH, fsdp2_problem

REPO = Path(__file__).resolve().parent.parent

# What `torch.distributed.fsdp` exports in torch 2.5.1 (its __all__): FSDP1 only.
TORCH_2_5_FSDP = (
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
)


def test_fsdp_refuses_a_torch_older_than_the_floor_naming_the_version_it_needs():
    assert fsdp2_problem(torch.distributed.fsdp, torch.__version__) is None
    older = types.SimpleNamespace(**dict.fromkeys(TORCH_2_5_FSDP, object))
    problem = fsdp2_problem(older, "2.5.1+cu124")
    assert problem is not None
    assert f"strategy='fsdp' needs torch>={FSDP2_TORCH}" in problem and "this is torch 2.5.1+cu124" in problem
    assert "fully_shard" in problem and "register_fsdp_forward_method" in problem
    assert "strategy='ddp'" in problem
    # 2.7 has the names, but its sharded training on gloo gave other values than one process
    problem = fsdp2_problem(torch.distributed.fsdp, "2.7.1+cu126")
    assert problem is not None and "this is torch 2.7.1+cu126: it is older than that" in problem


def _floor(text: str, pattern: str) -> str:
    found = re.search(pattern, text)
    assert found, pattern
    return found.group(1)


def test_pyproject_readme_and_ci_state_the_same_tested_range():
    readme = (REPO / "README.md").read_text()
    floor = _floor((REPO / "pyproject.toml").read_text(), r'"torch>=([0-9.]+)"')
    oldest, newest = re.search(r"Tested with torch ([0-9.]+) and ([0-9.]+)", readme).groups()
    ci_floor = _floor((REPO / ".ci" / "run").read_text(), r'FLOOR_TORCH="([0-9.]+)"')
    assert floor == FSDP2_TORCH and oldest == ci_floor and oldest.startswith(floor + ".")
    assert (
        newest
        == _floor(readme, r"pip install torch==([0-9.]+) -e")
        == _floor((REPO / ".ci" / "run").read_text(), r'"torch==([0-9.]+)"')
    )
