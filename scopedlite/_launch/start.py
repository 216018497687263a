"""Starting the other local ranks: re-executing the command line, or forking.

Both hand a worker the same facts: its rank, the world size, where rank 0's store listens,
and where to write its traceback if it fails. A re-executed worker reads them from its
environment; a forked one receives the store's port through a pipe (the store is created
after the fork, so no socket is shared between processes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scopedlite._cluster.environments import ENV
from scopedlite._hardware.program import this_program
from scopedlite._launch.supervise import (
    ForkedWorker,
    PopenWorker,
    _libc,
    set_parent_death_signal,
)

__all__ = ["ForkChild", "fork_workers", "script_command", "start_script_workers", "threads_per_process"]


def threads_per_process(cpu_count: int, local_world_size: int) -> int:
    """Torch threads per process so N processes share C cores as Fabric does: max(1, C // N)."""
    return max(1, cpu_count // max(1, local_world_size))


def script_command() -> tuple[list[str], str | None]:
    """The command line that started this program, ready to run again, and where to run it.

    Exactly what the user typed (``sys.orig_argv``, read by the interpreter's own grammar),
    with the script's path made absolute, whatever the script did to ``sys.argv`` since;
    the directory is the one this program started in (see
    :mod:`scopedlite._hardware.program`).

    Raises:
        ValueError: The command line cannot start this program again (an embedding host, a
            runner such as pdb or runpy); the message names the reason and the way out.
    """
    program = this_program()
    if program.command is None:
        raise ValueError(
            f"launcher='script' cannot start the workers: {program.problem or 'there is no command line to re-run.'}"
        )
    return list(program.command), program.directory


def worker_environment(
    *,
    global_rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    port: int,
    token: str,
    site: str,
    error_dir: Path,
    threads: int,
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(global_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "GROUP_RANK": "0",
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            ENV.TOKEN: token,
            ENV.SITE: site,
            ENV.ERROR_FILE: str(error_dir / f"rank{global_rank}.txt"),
            ENV.PARENT_PID: str(os.getpid()),
        }
    )
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def start_script_workers(
    local_world_size: int, port: int, token: str, site: str, error_dir: Path, threads: int
) -> list[PopenWorker]:
    _libc()  # load before forking: the preexec hook must not import or dlopen
    parent = os.getpid()
    command, cwd = script_command()
    workers = []
    for rank in range(1, local_world_size):
        env = worker_environment(
            global_rank=rank,
            local_rank=rank,
            world_size=local_world_size,
            local_world_size=local_world_size,
            port=port,
            token=token,
            site=site,
            error_dir=error_dir,
            threads=threads,
        )
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: set_parent_death_signal(parent),
        )
        workers.append(PopenWorker(rank, process))
    return workers


@dataclass
class ForkChild:
    """What a forked worker knows right after the fork."""

    local_rank: int
    port_pipe: int

    def read_port(self) -> int:
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(self.port_pipe, 64)
            if not chunk:  # rank 0 failed before it could start the store
                os._exit(1)
            data += chunk
        os.close(self.port_pipe)
        return int(data)


@dataclass
class ForkParent:
    workers: list[ForkedWorker]
    port_pipes: list[int]

    def send_port(self, port: int) -> None:
        for pipe in self.port_pipes:
            try:
                os.write(pipe, f"{port}\n".encode())
            except BrokenPipeError:  # that worker died already; the supervisor reports it
                pass
            os.close(pipe)
        self.port_pipes = []

    def close(self) -> None:
        for pipe in self.port_pipes:
            os.close(pipe)
        self.port_pipes = []


def fork_workers(local_world_size: int) -> ForkParent | ForkChild:
    """Fork one child per other local rank. Returns in the parent and in every child."""
    _libc()
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    workers: list[ForkedWorker] = []
    pipes: list[int] = []
    for rank in range(1, local_world_size):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            for pipe in pipes:  # siblings' pipes, inherited from the parent
                os.close(pipe)
            os.setsid()
            set_parent_death_signal(parent)
            return ForkChild(rank, read)
        os.close(read)
        workers.append(ForkedWorker(rank, pid))
        pipes.append(write)
    return ForkParent(workers, pipes)
