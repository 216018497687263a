"""Run test scripts in processes forked from one that has imported torch already.

Most of a test script's run is not its test: ``import torch`` and the first optimizer (which
imports ``torch._dynamo``) cost ~4.5 s of CPU per process, and a 2-rank script started as
``python script.py`` is three such processes, ~15 times the few tenths of a second its
training takes. This module is both ends of a cheaper start:

- run as ``python tests/zygote.py``, it is the *zygote*: it imports torch, ``torch._dynamo``
  and scopedlite once, then reads one request per line on stdin and forks a child per request;
- :class:`Zygote` (used by ``conftest.py``) starts it and runs scripts through it.

A child runs the script as ``runpy`` runs a file (``__main__``, its own folder first on
``sys.path``, the arguments, environment and working directory it was given), with its output
in files. It has no command line of its own to re-execute, like a notebook, so the script's
``lite.launch`` forks its workers (``launcher="auto"`` -> ``"fork"``). Every strategy and every
result is as real as in a fresh interpreter; what differs is how the workers start.
Re-executing the command line (``launcher="script"``) is tested by the tests that start
``python script.py`` themselves (``run_python``, ``script(..., fresh=True)``): the launch,
CLI, example, docs and world tests, and half the fault cases.

Environment variables that torch or scopedlite read at import are the zygote's (its start
environment: the test process's), not a request's; a test that sets one runs fresh.

A zygote may also *preload* modules (``Zygote(preload=("deepspeed",))``): importing DeepSpeed
costs 5-9 s of CPU in every rank of every DeepSpeed launch, as a user's script that imports
it at its top pays once. So does what ``deepspeed.initialize`` imports on its first call, once
per process: its check of the optimizer imports its Muon optimizer, whose ``torch.compile``
decorators import ``torch._inductor`` (~2.6 s of CPU per rank here, DeepSpeed 0.19), a name
that ends with "?" being imported where the version has it. The plain zygote never imports
DeepSpeed, so a check that a run does not import DeepSpeed, or restores what its import sets
in ``os.environ``, holds its meaning there.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent


class Zygote:
    """One zygote process, started on first use, and the scripts it runs, one at a time."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self.preload = preload

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float, stdout: Path, stderr: Path) -> int:
        """Run ``python *argv`` (a script path first) in a fork; return its exit code as
        ``subprocess`` gives it (negative: killed by that signal).

        Raises:
            subprocess.TimeoutExpired: It ran past ``timeout``; it and every process it
                started are killed first.
        """
        proc = self._started()
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        proc.stdin.write((json.dumps(request) + "\n").encode())
        pid = int(self._line(time.monotonic() + 60))
        deadline = time.monotonic() + timeout
        code = None
        try:
            code = int(self._line(deadline))
            return code
        except TimeoutError:
            raise subprocess.TimeoutExpired(argv, timeout) from None
        finally:
            if code is None:  # timed out, or the test was interrupted (pytest-timeout): leave nothing
                _kill_tree(pid)
                try:
                    self._line(time.monotonic() + 30)  # the zygote reports the reaped child
                except (TimeoutError, EOFError):
                    self.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ)
            if "deepspeed" in self.preload:  # the tests run DeepSpeed on CPU; detected, it warns
                env.setdefault("DS_ACCELERATOR", "cpu")
            self._proc = subprocess.Popen(
                [sys.executable, "-u", str(Path(__file__).resolve()), *self.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,  # unbuffered: see _line
                env=env,
            )
            if self._line(time.monotonic() + 120) != "ready":
                raise RuntimeError("the zygote did not start")
        return self._proc

    def _line(self, deadline: float) -> str:
        """The zygote's next line, read a byte at a time: a buffered reader could take the
        exit code along with the pid, and select would then wait for a line already read."""
        fd = self._proc.stdout.fileno()
        line = b""
        while not line.endswith(b"\n"):
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
            byte = os.read(fd, 1)
            if not byte:
                self.close()
                raise EOFError("the zygote ended")
            line += byte
        return line.decode().strip()


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# -- the zygote itself -----------------------------------------------------------------------


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), so a killed test session leaves no
    zygote and no script behind."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def _serve(preload: list[str]) -> None:
    _die_with_parent()
    import importlib

    import torch

    import scopedlite  # noqa: F401

    # What every script pays for before its first line of test: torch's optimizers import
    # torch._dynamo on construction; the distributed pieces each strategy uses.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.nn.parallel

    with contextlib.redirect_stdout(sys.stderr):  # stdout is the line protocol with the tests
        for name in preload:
            try:
                importlib.import_module(name.rstrip("?"))
            except ImportError:
                if not name.endswith("?"):  # "?": where this version has it
                    raise
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


def _child(request: dict) -> None:
    code = 1
    try:
        os.setsid()  # its own session: a terminal's signals reach it as they reach a fresh run
        _die_with_parent()
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = os.path.abspath(request["argv"][0])
        sys.argv = [script, *request["argv"][1:]]
        # No command line to start this program again (a notebook's case): launch forks.
        sys.orig_argv = [sys.executable]
        sys.path.insert(0, os.path.dirname(script))
        code = _run(script)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(script: str) -> int:
    """Run ``script`` as the interpreter runs a file; its exit code as the interpreter gives it."""
    import atexit
    import runpy
    import traceback

    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught error
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter runs at exit; os._exit skips it
    return code


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    _serve(sys.argv[1:])
