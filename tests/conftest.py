"""Shared fixtures: running real multi-process scripts, and guards against leaks.

Every test fails if it leaves behind an environment variable, a torch.distributed process
group, a child process, or an open scope.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(autouse=True)
def no_leaks():
    from scopedlite._core.scope import open_scopes

    env_before = dict(os.environ)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    # torch itself writes TORCHINDUCTOR_* on first use of some modules; that is not ours.
    ignored = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_")
    env_after = {k: v for k, v in os.environ.items() if not k.startswith(ignored)}
    env_before = {k: v for k, v in env_before.items() if not k.startswith(ignored)}
    assert env_after == env_before, "the test changed os.environ"
    assert not dist.is_initialized(), "the test left a torch.distributed process group"
    assert open_scopes() == (), f"the test left scopes open: {open_scopes()}"
    deadline = time.monotonic() + 5
    while True:
        leftover = [
            p for p in psutil.Process().children(recursive=True)
            if p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE
        ]
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leftover, f"the test left processes behind: {leftover}"


class ScriptResult:
    def __init__(self, proc: subprocess.CompletedProcess[str], out: Path, seconds: float) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.seconds = seconds
        self._out = out

    def json(self) -> Any:
        return json.loads(self._out.read_text())

    def explain(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@pytest.fixture
def run_python(tmp_path):
    """Run ``python <argv...>`` in a fresh interpreter; the script may write JSON to $OUT."""

    def run(*argv: str, timeout: float = 90, env: dict[str, str] | None = None, cwd: Path | None = None) -> ScriptResult:
        out = tmp_path / f"out-{time.monotonic_ns()}.json"
        full_env = _env()
        full_env["OUT"] = str(out)
        full_env.update(env or {})
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=str(cwd or tmp_path),
        )
        return ScriptResult(proc, out, time.monotonic() - start)

    return run


@pytest.fixture
def script(run_python):
    """Run one of tests/scripts/<name>.py with arguments."""

    def run(name: str, *args: str, **kwargs: Any) -> ScriptResult:
        return run_python(str(SCRIPTS / f"{name}.py"), *map(str, args), **kwargs)

    return run
