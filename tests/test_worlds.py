"""Real worlds made by other tools: two-node torchrun, mpirun, and srun on a real SLURM.

Each test starts the real tool and is skipped, with the reason, where the tool is missing
(CI installs them: see .ci/run). Where SLURM is installed (and we are root), a SLURM that does
not start is a failure, not a skip: a broken start-up path must not pass as "not here". The
scripts are the ones our own launcher runs, unchanged: launch finds the world in the environment
and joins it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, _env

sys.path.insert(0, str(SCRIPTS))
from _common import assert_close, reference_training


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (each held until all are chosen)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _expected(n: int, world_size: int, batch: int) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in reference_training(n, world_size, batch).parameters()]


def _assert_trained_like_reference(out: dict, n: int, world_size: int, batch: int) -> None:
    expected = _expected(n, world_size, batch)
    assert out["world_size"] == world_size
    assert_close(out["params"], expected, 1e-5, "parameters")
    first = out["first_param_on_each_rank"]
    assert len(first) == world_size and all(row == first[0] for row in first)
    # every rank's all_reduce(mean) of the loss equals the mean of the ranks' own losses
    ranks = out["ranks"]
    assert len(ranks) == world_size and len(ranks[0]["means"]) == n // world_size // batch
    for step, mean in enumerate(ranks[0]["means"]):
        own = [r["locals"][step] for r in ranks]
        assert mean == pytest.approx(sum(own) / len(own), rel=1e-5)


def _assert_joined(out: dict, source: str, world_size: int) -> None:
    """The environment's world was joined: nobody spawned anyone, all_reduce is right."""
    assert out["source"] == source and out["world_size"] == world_size
    assert out["sum"] == world_size * (world_size + 1) // 2
    assert [r["rank"] for r in out["ranks"]] == list(range(world_size))
    assert len({r["pid"] for r in out["ranks"]}) == world_size
    assert all(r["children"] == 0 for r in out["ranks"]), out["ranks"]


def _communicate(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


@pytest.mark.timeout(150)
def test_two_torchrun_nodes_form_one_world_that_trains_like_one_process(tmp_path):
    """Two `torchrun --nnodes 2` invocations, 2 processes each: one 4-rank world."""
    import datetime

    import torch.distributed as dist

    n, batch, port = 32, 4, _free_port()
    env = _env() | {"OUT": str(tmp_path / "out.json")}
    # The rendezvous endpoint is hosted here, so it outlives both nodes. When one node's
    # torchrun agent hosts it (both agents run on 127.0.0.1 here) and exits first, the other
    # agent, still polling the rendezvous, fails at shutdown with RendezvousConnectionError
    # (torch 2.13's elastic agent; the run itself is done by then): a race of torchrun's, not
    # of the run under test.
    endpoint = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=130)
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "worlds-test",
                "--rdzv-conf",
                "is_host=false",
                str(SCRIPTS / "train.py"),
                "ddp",
                "2",
                str(n),
                str(batch),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        results = _communicate(procs, timeout=130)
    finally:
        del endpoint
    # every node's output on a failure: the first rank to fail may be on the other node
    report = "\n".join(f"--- node {node}: exit {code}\n{out}\n{err}" for node, (code, out, err) in enumerate(results))
    assert all(code == 0 for code, _, _ in results), report
    _assert_trained_like_reference(json.loads((tmp_path / "out.json").read_text()), n, 4, batch)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_mpirun_ranks_form_one_world(tmp_path):
    n, batch = 16, 4
    env = _env()
    env.pop("MASTER_ADDR", None)
    mpirun = ["mpirun", "-n", "2", "--allow-run-as-root", "--oversubscribe", sys.executable]
    for name, args in (("world", []), ("train", ["ddp", "2", str(n), str(batch)])):
        # The first run derives its port from mpirun's job id; the second is given a free one,
        # as a user exporting MASTER_PORT would (a derived port can collide on a busy machine).
        extra = {"OUT": str(tmp_path / f"{name}.json")}
        if name == "world":
            env.pop("MASTER_PORT", None)
        else:
            extra["MASTER_PORT"] = str(_free_port())
        proc = subprocess.run(
            [*mpirun, str(SCRIPTS / f"{name}.py"), *args],
            env=env | extra,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    _assert_joined(json.loads((tmp_path / "world.json").read_text()), "openmpi", 2)
    _assert_trained_like_reference(json.loads((tmp_path / "train.json").read_text()), n, 2, batch)


# -- a real single-node SLURM ----------------------------------------------------------------
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sinfo", "munged")


def _slurm_missing() -> str | None:
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return (
            f"SLURM not installed ({', '.join(missing)} missing; apt-get install slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd needs root"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Slurm:
    """slurmctld + slurmd + munged for one node, all state in a temp dir, stopped by pidfile."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="scopedlite-slurm-"))
        self.env = {k: v for k, v in _env().items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(self.dir / "slurm.conf")
        self.pidfiles = [self.dir / "slurmctld.pid", self.dir / "slurmd.pid", self.dir / "munged.pid"]

    def start(self) -> None:
        d = self.dir
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir()
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = d / "munge" / "munge.socket"
        subprocess.run(
            [
                _tool("munged"),
                "--force",
                f"--key-file={key}",
                f"--socket={socket_path}",
                f"--pid-file={d / 'munged.pid'}",
                f"--log-file={d / 'munged.log'}",
                f"--seed-file={d / 'munge' / 'seed'}",
            ],
            check=True,
            capture_output=True,
            timeout=20,
        )
        node = subprocess.run([_tool("slurmd"), "-C"], capture_output=True, text=True, timeout=20, check=True)
        node_line = next(line for line in node.stdout.splitlines() if line.startswith("NodeName="))
        ports = _free_ports(2)
        (d / "slurm.conf").write_text(
            "\n".join(
                [
                    "ClusterName=scopedlite",
                    f"SlurmctldHost={host}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={socket_path}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                    f"SlurmdPidFile={d / 'slurmd.pid'}",
                    f"StateSaveLocation={d / 'state'}",
                    f"SlurmdSpoolDir={d / 'spool'}",
                    f"SlurmctldLogFile={d / 'slurmctld.log'}",
                    f"SlurmdLogFile={d / 'slurmd.log'}",
                    # free ports, not fixed ones: 46817-46818 lie in Linux's ephemeral range, where
                    # a gloo or store connection of a test running beside this one took 46818 once
                    f"SlurmctldPort={ports[0]}",
                    f"SlurmdPort={ports[1]}",
                    node_line.replace(node_line.split()[0], f"NodeName={host}") + " State=UNKNOWN",
                    f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run(
                [_tool(daemon), "-f", str(d / "slurm.conf")] + (["-c"] if daemon == "slurmctld" else []),
                check=True,
                capture_output=True,
                timeout=20,
                env=self.env,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(
                [_tool("sinfo"), "-h", "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=10
            )
            if out.stdout.strip() == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"SLURM did not become idle: {out.stdout!r} {out.stderr!r}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.dir.glob("*.log"))

    def stop(self) -> None:
        import signal

        for pidfile in self.pidfiles:
            try:
                pid = int(pidfile.read_text())
            except (FileNotFoundError, ValueError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm():
    reason = _slurm_missing()
    if reason:
        pytest.skip(reason)
    cluster = Slurm()
    try:
        cluster.start()
    except Exception as e:  # noqa: BLE001 - reported with the daemons' logs
        logs = cluster.logs()
        cluster.stop()
        pytest.fail(f"SLURM is installed but a single-node SLURM did not start: {e!r}\n{logs}")
    yield cluster
    cluster.stop()


@pytest.mark.timeout(120)
def test_srun_tasks_form_one_world(slurm, tmp_path):
    n, batch = 16, 4
    srun = [_tool("srun"), "-N1", "-n2", "--overcommit", sys.executable]
    for name, args in (("world", []), ("train", ["ddp", "2", str(n), str(batch)])):
        proc = subprocess.run(
            [*srun, str(SCRIPTS / f"{name}.py"), *args],
            env=slurm.env | {"OUT": str(tmp_path / f"{name}.json")},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    _assert_joined(json.loads((tmp_path / "world.json").read_text()), "slurm", 2)
    _assert_trained_like_reference(json.loads((tmp_path / "train.json").read_text()), n, 2, batch)


@pytest.mark.timeout(120)
def test_sbatch_script_launches_its_own_ranks_before_srun(slurm, tmp_path):
    """The sbatch trap: SLURM_PROCID/NTASKS are set in the batch script, yet it is no world."""
    n, batch, out = 16, 4, tmp_path / "out.json"
    job = tmp_path / "job.sh"
    job.write_text(
        f"#!/bin/bash\ncd {tmp_path}\nexport OUT={out}\n"
        f"echo PROCID=$SLURM_PROCID NTASKS=$SLURM_NTASKS STEP_TASKS=${{SLURM_STEP_NUM_TASKS:-unset}}\n"
        f"{sys.executable} {SCRIPTS / 'train.py'} ddp 2 {n} {batch}\n"
    )
    log = tmp_path / "job.log"
    submit = subprocess.run(
        [_tool("sbatch"), "--wait", "-N1", "-n2", "--overcommit", f"--output={log}", str(job)],
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    text = log.read_text() if log.exists() else ""
    assert submit.returncode == 0, f"{submit.stdout}\n{submit.stderr}\n{text}"
    assert "PROCID=0 NTASKS=2 STEP_TASKS=unset" in text, text
    _assert_trained_like_reference(json.loads(out.read_text()), n, 2, batch)
