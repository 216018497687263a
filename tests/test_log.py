"""``lite.log`` / ``lite.log_dict`` to ``launch(loggers=[...])``: values read back from the
CSV file and from TensorBoard's event files with TensorBoard's own reader, written once on 2
ranks, and on disk after a failing block."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

import scopedlite as lite
from conftest import SCRIPTS, run_warm


def rows(path):
    with open(path, newline="") as f:
        return [(int(r["step"]), r["name"], float(r["value"])) for r in csv.DictReader(f)]


def scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


class Recorder:
    """A logger of our own: the protocol is two methods."""

    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((dict(metrics), step))

    def finalize(self, status):
        self.calls.append(status)


def test_csv_and_tensorboard_get_every_value_exactly(tmp_path):
    recorder = Recorder()
    loggers = [lite.CSVLogger(tmp_path / "logs" / "m.csv"), lite.TensorBoardLogger(tmp_path / "tb"), recorder]
    with lite.launch(accelerator="cpu", loggers=loggers):
        lite.log("loss", torch.tensor(0.1 + 0.2, dtype=torch.float64))  # a one-element tensor: .item()
        lite.log("loss", 0.25)  # step None: the name's next step (1)
        lite.log("loss", 1 / 3, step=10)
        lite.log_dict({"acc": 0.5, "lr": torch.tensor([1e-3], dtype=torch.float64)}, step=10)
        lite.log("acc", 0.75)  # next step of "acc": 11
    assert rows(tmp_path / "logs" / "m.csv") == [
        (0, "loss", 0.1 + 0.2), (1, "loss", 0.25), (10, "loss", 1 / 3),
        (10, "acc", 0.5), (10, "lr", 1e-3), (11, "acc", 0.75),
    ]  # fmt: skip
    tb = scalars(tmp_path / "tb")
    assert tb["loss"] == [(0, pytest.approx(0.3)), (1, 0.25), (10, pytest.approx(1 / 3))]  # float32 in the file
    assert tb["acc"] == [(10, 0.5), (11, 0.75)] and tb["lr"] == [(10, pytest.approx(1e-3))]
    assert recorder.calls[3] == ({"acc": 0.5, "lr": 1e-3}, 10) and recorder.calls[-1] == "success"


def test_a_logger_reused_by_a_later_block_continues_its_file(tmp_path):
    logger = lite.CSVLogger(tmp_path / "m.csv")
    for value in (1.0, 2.0):
        with lite.launch(accelerator="cpu", loggers=logger):
            lite.log("x", value)
    assert rows(tmp_path / "m.csv") == [(0, "x", 1.0), (0, "x", 2.0)]  # each run counts from 0
    with lite.launch(accelerator="cpu", loggers=lite.CSVLogger(tmp_path / "m.csv")):  # a new logger starts afresh
        lite.log("x", 3.0)
    assert rows(tmp_path / "m.csv") == [(0, "x", 3.0)]
    with lite.launch(accelerator="cpu", loggers=lite.CSVLogger(tmp_path / "m.csv", append=True)):
        lite.log("x", 4.0, step=1)
    assert rows(tmp_path / "m.csv") == [(0, "x", 3.0), (1, "x", 4.0)]


def test_values_logged_before_a_failure_are_on_disk(tmp_path):
    recorder = Recorder()
    with (
        pytest.raises(ZeroDivisionError),
        lite.launch(
            accelerator="cpu",
            loggers=[lite.CSVLogger(tmp_path / "m.csv"), lite.TensorBoardLogger(tmp_path / "tb"), recorder],
        ),
    ):
        lite.log("loss", 2.0)
        _ = 1 / 0
    assert rows(tmp_path / "m.csv") == [(0, "loss", 2.0)]
    assert scalars(tmp_path / "tb") == {"loss": [(0, 2.0)]}
    assert recorder.calls[-1] == "failed"


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (
            lambda: (lite.log("a", 1.0, step=5), lite.log("a", 2.0, step=5)),
            ValueError,
            ["step=5 for 'a'", "last step 5", "step=6"],
        ),
        (lambda: (lite.log("a", 1.0, step=5), lite.log("a", 2.0, step=3)), ValueError, ["step=3 for 'a'"]),
        (lambda: lite.log("a", 1.0, step=-1), ValueError, ["step=-1", ">= 0"]),
        (lambda: lite.log("a", "1.0"), TypeError, ["lite.log('a', '1.0')", "str"]),
        (lambda: lite.log("a", torch.ones(2)), ValueError, ["shape (2,)", ".item()"]),
        (lambda: lite.log("", 1.0), TypeError, ["non-empty strings"]),
        (lambda: lite.log_dict([("a", 1.0)]), TypeError, ["mapping"]),
    ],
)
def test_bad_calls_are_refused_and_nothing_is_written(tmp_path, call, error, words):
    recorder = Recorder()
    with lite.launch(accelerator="cpu", loggers=recorder), pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), str(info.value)
    assert all(metrics == {"a": 1.0} for metrics, _ in recorder.calls[:-1])  # the refused call wrote nothing


def test_a_steps_check_holds_for_each_name_alone():
    recorder = Recorder()
    with lite.launch(accelerator="cpu", loggers=recorder):
        lite.log("a", 1.0, step=5)
        lite.log("b", 1.0, step=2)  # another name: its own steps
    assert recorder.calls == [({"a": 1.0}, 5), ({"b": 1.0}, 2), "success"]


def test_launch_refuses_what_is_not_a_logger():
    with pytest.raises(TypeError) as info, lite.launch(accelerator="cpu", loggers=[lite.CSVLogger("m.csv"), "tb"]):
        pass
    assert "loggers[1]='tb' is not a logger" in str(info.value) and "log_metrics(metrics, step)" in str(info.value)


def test_outside_a_launch_log_checks_and_writes_nothing():
    lite.log("a", 1.0)
    with pytest.raises(TypeError):
        lite.log("a", object())


TWO_RANKS = """
import json, os, sys, scopedlite as lite
from scopedlite import WorkerFailedError
folder = sys.argv[1]
loggers = [lite.CSVLogger(folder + "/ok.csv"), lite.TensorBoardLogger(folder + "/tb")]
with lite.launch(accelerator="cpu", strategy="ddp", devices=2, loggers=loggers) as run:
    for step in range(3):
        lite.log("rank", run.global_rank, step=step)          # rank 0's value, written once
        lite.log("mean", lite.all_reduce(float(run.global_rank + step), op="mean"))
# A later block forks; rank 1 fails after rank 0 logged: rank 0's values are flushed anyway.
try:
    failed = lite.CSVLogger(folder + "/failed.csv")
    with lite.launch(accelerator="cpu", strategy="ddp", devices=2, loggers=failed) as run:
        lite.log("loss", 7.0)
        if run.global_rank == 1:
            raise KeyError("rank 1 fails")
        lite.barrier()
except WorkerFailedError as e:
    print("failed as expected:", "rank 1 fails" in str(e))
"""


@pytest.mark.timeout(120)
def test_two_ranks_write_once_and_a_failing_run_keeps_its_values(tmp_path):
    (tmp_path / "two.py").write_text(TWO_RANKS)
    result = run_warm(tmp_path / "two.py", tmp_path, tmp_path=tmp_path)
    assert result.returncode == 0, result.explain()
    assert "failed as expected: True" in result.stdout, result.explain()
    assert rows(tmp_path / "ok.csv") == [
        (0, "rank", 0.0), (0, "mean", 0.5), (1, "rank", 0.0), (1, "mean", 1.5), (2, "rank", 0.0), (2, "mean", 2.5),
    ]  # fmt: skip
    assert scalars(tmp_path / "tb") == {"rank": [(0, 0.0), (1, 0.0), (2, 0.0)], "mean": [(0, 0.5), (1, 1.5), (2, 2.5)]}
    assert rows(tmp_path / "failed.csv") == [(0, "loss", 7.0)]


def test_csv_rows_reach_the_file_as_they_are_logged(tmp_path):
    with lite.launch(accelerator="cpu", loggers=lite.CSVLogger(tmp_path / "m.csv")):
        lite.log("x", 1.5)
        assert rows(tmp_path / "m.csv") == [(0, "x", 1.5)]  # before the block ends: a SIGKILL loses nothing


# -- Weights & Biases (offline) and MLflow (a local folder store), read back with their own code --


def wandb_records(run_dir):
    """The records of a W&B offline run file, parsed with wandb's own protobuf classes.

    The file is a log of records (wandb's datastore format): a 7-byte header (":W&B",
    magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
    (CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a
    header is padding."""
    import struct
    from pathlib import Path

    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:7]
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros: the rest of the block is padding
            pos += left
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_values(records):
    """(lite/step, name, value) of every history row, and the run's exit code."""
    import json

    values, exit_code = [], None
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            values += [(row["lite/step"], k, v) for k, v in row.items() if not k.startswith("_") and k != "lite/step"]
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return sorted(values), exit_code


TRACKERS = {"wandb": "WandbLogger", "mlflow": "MLFlowLogger"}


@pytest.mark.timeout(150)
def test_wandb_offline_and_mlflow_get_what_rank_0_logged(tmp_path):
    for package in ("wandb", "mlflow"):  # found, not imported: mlflow takes seconds
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"lite.{TRACKERS[package]} needs {package}: pip install 'scopedlite[{package}]'")

    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    result = run_warm(SCRIPTS / "trackers.py", tmp_path, tmp_path=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.explain()
    runs = result.json()
    assert runs["imported_early"] == []  # imported on rank 0's first write, not by scopedlite
    logged = [
        (0, "loss", 0.1 + 0.2), (1, "loss", 0.25), (3, "val_loss", 2.5), (10, "acc", 0.5), (10, "loss", 1 / 3),
        (10, "rank", 0.0), (11, "acc", 0.75), (12, "mean", 0.5),
    ]  # fmt: skip
    (first_id, first_dir), (second_id, second_dir) = runs["first"]["wandb"], runs["second"]["wandb"]
    assert first_id != second_id  # a reused logger starts a new run in a later block
    assert sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*")) == sorted(
        [Path(first_dir).name, Path(second_dir).name]
    )  # rank 1 started no run
    assert wandb_values(wandb_records(first_dir)) == (sorted(logged), 0)  # exact float64 values
    assert wandb_values(wandb_records(second_dir)) == ([(0, "loss", 7.0)], 1)
    config = next(r.run.config for r in wandb_records(first_dir) if r.WhichOneof("record_type") == "run")
    assert {item.key: item.value_json for item in config.update}["lr"] == "0.1"

    # MLflow's folder store, read as files: in maintenance mode since MLflow 3, its format no
    # longer changes (importing mlflow here would cost seconds more)
    first, second = (mlflow_run(tmp_path / "mlruns", runs[block]["mlflow"]) for block in ("first", "second"))
    assert first["metrics"] == sorted(logged)
    assert first["status"] == "FINISHED" and first["params"] == {"lr": "0.1"}
    assert second["metrics"] == [(0, "loss", 7.0)] and second["status"] == "FAILED"
    assert first["experiment"] == second["experiment"] == "lite-test"


def mlflow_run(store, run_id):
    """One run of an MLflow folder store: metrics/<name> holds "<ms> <value> <step>" lines,
    params/<name> the value, meta.yaml the status (mlflow.entities.RunStatus: 3 FINISHED,
    4 FAILED)."""
    (run,) = store.glob(f"*/{run_id}")
    fields = dict(line.split(": ", 1) for line in (run / "meta.yaml").read_text().splitlines() if ": " in line)
    experiment = dict(
        line.split(": ", 1) for line in (run.parent / "meta.yaml").read_text().splitlines() if ": " in line
    )
    metrics = [
        (int(step), path.name, float(value))
        for path in (run / "metrics").iterdir()
        for _, value, step in (line.split() for line in path.read_text().splitlines())
    ]
    return {
        "metrics": sorted(metrics),
        "params": {path.name: path.read_text() for path in (run / "params").iterdir()},
        "status": {"3": "FINISHED", "4": "FAILED"}.get(fields["status"], fields["status"]),
        "experiment": experiment["name"],
    }


def test_tracker_loggers_check_their_arguments():
    with pytest.raises(ValueError, match=r"mode='offfline'"):
        lite.WandbLogger(mode="offfline")
    with pytest.raises(TypeError, match=r"save_dir=3"):
        lite.WandbLogger(save_dir=3)
    with pytest.raises(TypeError, match=r"experiment_name=''"):
        lite.MLFlowLogger("")
