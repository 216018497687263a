"""launch joins a default process group made before it, and never destroys it: one made by
hand with init_process_group, and the ones Ray Train makes in its workers (a real
TorchTrainer with 2 CPU workers, ddp, fsdp and deepspeed in one Ray run).

Each run trains the unchanged loop of tests/scripts/existing_group.py over 9 samples on 2 ranks
(3 batches and 2) under lite.join; the final parameters are compared with a one-process
reference computed here with plain torch.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, _env

sys.path.insert(0, str(SCRIPTS))
from _common import assert_close, max_diff, params, reference_training

N, BATCH = 9, 2  # as in existing_group.py


def _check_runs(out: Path, strategy: str) -> None:
    records = [json.loads((out / f"{strategy}.rank{r}.json").read_text()) for r in (0, 1)]
    assert records[0]["seen"] == [0, 2, 4, 6, 8] and records[1]["seen"] == [1, 3, 5, 7]
    assert sorted(records[0]["seen"] + records[1]["seen"]) == list(range(N)), "every sample once"
    reference = params(reference_training(N, 2, BATCH))
    for rank, record in enumerate(records):
        assert record["place"] == [rank, rank, 2, 2], strategy  # global, local, world, local world
        assert_close(record["params"], reference, 1e-5, f"{strategy} rank {rank}'s parameters")
        assert record["loaded"] == record["params"], f"{strategy}: the checkpoint did not load back"
        # The group was not destroyed: still there after the block, and it still reduces.
        assert record["group_after"] == [True, 2, "gloo", 2.0], strategy


def test_a_group_made_by_hand_before_launch_is_joined_and_kept(tmp_path):
    """Two processes each call init_process_group (a file store, no torch variables in their
    environment), then run the loop under ddp; launch refuses sizes and a timeout it cannot honour."""
    env = {
        k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    rendezvous = tmp_path / "rendezvous"
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "existing_group.py"), str(rank), str(rendezvous), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    _check_runs(tmp_path, "ddp")
    for rank in (0, 1):
        said = json.loads((tmp_path / f"refusals.rank{rank}.json").read_text())
        assert (
            "3 process(es) per node on 1 node(s), but the process_group world has 2 per node and 2 in all"
            in said["devices"]
        )
        assert "2 process(es) per node on 2 node(s)" in said["num_nodes"]
        assert "launch(timeout=30)" in said["timeout"] and "init_process_group(timeout=...)" in said["timeout"]


@pytest.mark.deepspeed_op
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'ray[train]', in the test extra)"
)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.timeout(300)
def test_ray_train_runs_the_unchanged_loop_under_ddp_fsdp_and_deepspeed(tmp_path):
    strategies = ["ddp", "fsdp", "deepspeed"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ray_train.py"), str(tmp_path), *strategies],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    print(proc.stdout.splitlines()[-1])  # Ray's start-up and total seconds, for --durations readers
    for strategy in strategies:
        _check_runs(tmp_path, strategy)
    # The first block of each worker already ran on Ray's group: nothing else made one.
    first = json.loads((tmp_path / "ddp.rank1.json").read_text())
    assert first["env"]["RANK"] == "1" and first["env"]["LOCAL_RANK"] == "1"


def test_the_reference_is_not_the_untrained_model():
    """The comparison above can fail: training moved the parameters."""
    untrained = params(reference_training(N, 2, BATCH, lr=0.0))
    trained = params(reference_training(N, 2, BATCH))
    assert max_diff(untrained, trained) > 1e-2
