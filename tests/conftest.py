"""Shared fixtures: running real multi-process scripts, and guards against leaks.

A script runs forked from the zygote (tests/zygote.py: torch imported once per session; the
script's launch forks its workers), or with ``run_python`` / ``script(..., fresh=True)`` in a
fresh interpreter whose launch re-executes the command line (tests/README.md says which when).

Every test fails if it leaves behind an environment variable, a torch.distributed process
group, a child process, or an open scope.

DeepSpeed's C++ op (a one-time gcc build of 1-2 minutes) is built here once per machine,
before the first test that needs it and outside every per-test timeout, in one folder shared
by every test file: ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/scopedlite/torch_extensions``.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from zygote import Zygote

REPO = Path(__file__).resolve().parent.parent

# The test process computes the plain-torch references on tiny tensors, while the other xdist
# worker and the scripts' ranks keep both cores busy: with torch's default of one thread per
# core, each op waits for a thread on a busy core (test_join's references of torch's uneven
# suite took 5.3 s on 2 threads, 0.5 s on 1). The scripts' processes are not affected: the
# zygote and fresh interpreters start with their own count, and lite.launch gives each rank its
# share of the cores (SPEC 4).
torch.set_num_threads(1)
SCRIPTS = Path(__file__).resolve().parent / "scripts"

# One extension folder for the whole session (this process and every process a test starts),
# so DeepSpeed's op is built once and found by every test file.
EXTENSIONS_DIR = Path(
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR",
        str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scopedlite" / "torch_extensions"),
    )
)

_BUILD_OP = (
    "from deepspeed.accelerator import get_accelerator as g; "
    "b = g().create_op_builder('ShareMemCommBuilder'); b and b.load(verbose=False)"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deepspeed_op: uses DeepSpeed's C++ op, built once before the first such test")


# The longest files first. The two workers take whole files (pyproject: --dist loadfile), in
# collection order: a long file begun last runs alone at the end while the other worker idles;
# begun first, it overlaps the many short files. The rest keep their order.
LONGEST_FIRST = (
    "test_join.py",
    "test_hf_models.py",
    "test_checkpoint_moves.py",
    "test_faults.py",
    "test_launch.py",
    "test_worlds.py",
    "test_examples.py",
    "test_one_script.py",
    "test_docs.py",
    "test_existing_group.py",
    "test_deepspeed.py",
    "test_cli.py",
    "test_watchdog.py",
    "test_xla.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: within a file as written


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build DeepSpeed's op before the tests run (no per-test timeout applies to hooks)."""
    if session.config.option.collectonly or not any(
        i.get_closest_marker("deepspeed_op") or "deepspeed" in i.nodeid for i in session.items
    ):
        return
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return  # those tests skip, saying why
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else print
    start = time.monotonic()
    problem = build_deepspeed_op(EXTENSIONS_DIR)
    if problem:
        say(f"building DeepSpeed's op in {EXTENSIONS_DIR} failed; its tests will fail:\n{problem}")
    elif time.monotonic() - start > 5:
        say(f"built DeepSpeed's op once in {EXTENSIONS_DIR} ({time.monotonic() - start:.0f} s)")


def build_deepspeed_op(folder: Path) -> str | None:
    """Build (or find built) DeepSpeed's op in ``folder``; return what went wrong, if anything.

    Holds our own ``flock`` (released by the kernel when its holder dies, so never stale)
    while it clears torch's stale build locks and builds: another session building at the
    same time is waited for, and a build interrupted earlier does not block this one.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".scopedlite-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        clear_stale_build_locks(folder)
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder), "DS_ACCELERATOR": "cpu"}
        proc = subprocess.run([sys.executable, "-c", _BUILD_OP], env=env, capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]


def clear_stale_build_locks(folder: Path) -> list[Path]:
    """Remove torch's build locks (``<folder>/<op>/lock``) that no live process holds.

    torch's ``FileBaton`` creates the file and keeps it open until the build ends; a build
    killed by a timeout leaves it behind, and every later build then waits on it forever.
    """
    locks = [p for p in folder.glob("*/lock") if p.is_file()]
    if not locks:
        return []
    held: set[str] = set()
    for proc in psutil.process_iter():
        try:
            held.update(f.path for f in proc.open_files())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    removed = []
    for lock in locks:
        if str(lock) not in held and str(lock.resolve()) not in held:
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


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
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in children_before
            and p.pid not in (_ZYGOTE.pid, _DEEPSPEED_ZYGOTE.pid)
            and p.status() != psutil.STATUS_ZOMBIE
        ]
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leftover, f"the test left processes behind: {leftover}"


class ScriptResult:
    def __init__(self, returncode: int, stdout: str, stderr: str, out: Path, seconds: float) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
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


_ZYGOTE = Zygote()
# DeepSpeed's runs (a strategy named "deepspeed..." among the script's arguments) start from a
# zygote that imported DeepSpeed (zygote.py says why); where a GPU is visible DeepSpeed would
# pick it at import, so there they start from the plain one.
_DEEPSPEED_ZYGOTE = Zygote(
    preload=() if torch.cuda.is_available() else ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer?")
)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _ZYGOTE.close()
    _DEEPSPEED_ZYGOTE.close()


def run_warm(
    script: Path | str,
    *args: str,
    tmp_path: Path,
    timeout: float = 90,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    deepspeed: bool | None = None,
) -> ScriptResult:
    """Run ``python script *args`` forked from the zygote (tests/zygote.py: torch imported
    already, the script's launch forks its workers); the script may write JSON to $OUT.
    From the zygote that imported DeepSpeed with ``deepspeed=True``, or by default when an
    argument names a DeepSpeed strategy."""
    out = tmp_path / f"out-{time.monotonic_ns()}.json"
    full_env = _env()
    full_env["OUT"] = str(out)
    full_env.update(env or {})
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as printed:  # not in tmp_path, which scripts may list
        stdout, stderr = Path(printed, "stdout"), Path(printed, "stderr")
        try:
            if deepspeed is None:
                deepspeed = any(str(a).startswith("deepspeed") for a in args)
            zygote = _DEEPSPEED_ZYGOTE if deepspeed else _ZYGOTE
            code = zygote.run([str(script), *map(str, args)], full_env, cwd or tmp_path, timeout, stdout, stderr)
        except subprocess.TimeoutExpired as e:  # with what it printed, as subprocess.run gives it
            raise subprocess.TimeoutExpired(e.cmd, timeout, stdout.read_text(), stderr.read_text()) from None
        return ScriptResult(code, stdout.read_text(), stderr.read_text(), out, time.monotonic() - start)


@pytest.fixture
def run_python(tmp_path):
    """Run ``python <argv...>`` in a fresh interpreter; the script may write JSON to $OUT."""

    def run(
        *argv: str, timeout: float = 90, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> ScriptResult:
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
        return ScriptResult(proc.returncode, proc.stdout, proc.stderr, out, time.monotonic() - start)

    return run


@pytest.fixture
def script(run_python, tmp_path):
    """Run one of tests/scripts/<name>.py with arguments: forked from the zygote, or with
    ``fresh=True`` as ``python script.py`` (its launch re-executes the command line)."""

    def run(name: str, *args: str, fresh: bool = False, **kwargs: Any) -> ScriptResult:
        path = SCRIPTS / f"{name}.py"
        if fresh:
            return run_python(str(path), *map(str, args), **kwargs)
        return run_warm(path, *map(str, args), tmp_path=tmp_path, **kwargs)

    return run
