"""What README.md and examples/ show is run here, as a user would run it.

Every command an example's docstring shows (``python examples/x.py --flag``) is run by a test
below with exactly those arguments: RUN_HERE lists them, and a test checks that the list is
what the docstrings show. README's main job (train.py), README's first example and the
preempted run of resume.py start as typed, ``python x.py`` (workers re-execute the command
line); the other examples run forked from the test zygote (tests/zygote.py: torch imported
already, launch forks their workers): the same code and numbers, seconds sooner.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO, run_warm

pytestmark = pytest.mark.timeout(120)

# (example, arguments): every command the examples' docstrings show, each run below.
RUN_HERE = {
    ("train.py", ()),
    ("train.py", ("--devices", "1")),
    ("train.py", ("--precision", "bf16-mixed", "--epochs", "5")),
    ("eval_uneven.py", ()),
    ("eval_uneven.py", ("--devices", "4")),
    ("accumulate.py", ()),
    ("accumulate.py", ("--accumulate", "8")),
    ("sharded.py", ()),
    ("sharded.py", ("--strategy", "deepspeed_stage_3")),
    ("resume.py", ()),
    ("nanogpt.py", ()),
    ("nanogpt.py", ("--strategy", "fsdp")),
    ("nanogpt.py", ("--join",)),
}


def _docstring_commands() -> set[tuple[str, tuple[str, ...]]]:
    import ast

    commands = set()
    for path in sorted((REPO / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for line in doc.splitlines():
            match = re.match(r"\s*python examples/(\S+\.py)([^#]*)", line)
            if match:
                commands.add((match.group(1), tuple(match.group(2).split())))
    return commands


def test_every_command_an_example_docstring_shows_is_run_here():
    assert _docstring_commands() == RUN_HERE
    assert {name for name, _ in RUN_HERE} == {p.name for p in (REPO / "examples").glob("*.py")}


def _readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", readme, re.S).group(1)


@pytest.mark.parametrize(
    ("args", "processes", "epochs"),
    [((), 2, 3), (("--devices", "1"), 1, 3), (("--precision", "bf16-mixed", "--epochs", "5"), 2, 5)],
    ids=["ddp", "one-process", "bf16-mixed"],
)
def test_example_train_loss_falls(run_python, args, processes, epochs):
    result = run_python(str(REPO / "examples" / "train.py"), *args)
    assert result.returncode == 0, result.explain()
    losses = [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == epochs, result.stdout
    assert losses[-1] < losses[0] * 0.5, losses
    assert f"{processes} process(es) on cpu" in result.stdout
    assert result.stdout.count("done in") == 1  # after the block: once


def test_readme_first_example_runs_as_pasted_and_is_index_mds(run_python, tmp_path):
    snippet = _readme_example()
    index = (REPO / "docs" / "index.md").read_text()
    assert re.search(r"```python\n(.*?)```", index, re.S).group(1) == snippet  # one example, two pages
    script = tmp_path / "readme_example.py"
    script.write_text(snippet)  # nothing added: it runs as a newcomer pastes it
    result = run_python(str(script), timeout=60)
    assert result.returncode == 0, result.explain()
    assert (tmp_path / "ckpt.pt").exists()
    # 100 samples on 2 ranks in batches of 8: 50 each, 7 steps on each rank, printed once each
    losses = [float(v) for v in re.findall(r"^tensor\(([0-9.]+)", result.stdout, re.M)]
    assert len(losses) == 7, result.stdout
    assert "[rank 1]" not in result.stdout  # lite.print: rank 0 only


@pytest.fixture
def example(tmp_path):
    """Run examples/<name> with arguments, forked from the test zygote, in ``tmp_path``."""

    def run(name: str, *args: str, timeout: float = 90):
        return run_warm(REPO / "examples" / name, *args, tmp_path=tmp_path, timeout=timeout)

    return run


def _floats(pattern: str, text: str) -> list[float]:
    return [float(v) for v in re.findall(pattern, text)]


@pytest.mark.parametrize(("args", "devices"), [((), 3), (("--devices", "4"), 4)], ids=["3-ranks", "4-ranks"])
def test_example_eval_uneven_join_gives_the_one_process_mean(example, args, devices):
    # 4 ranks: 3, 3, 2 and 2 samples, so ranks 2-3 reach the all_reduce after the loop while
    # ranks 0-1 still run a forward: the collective waits for them, matched by its line
    result = example("eval_uneven.py", *args)
    assert result.returncode == 0, result.explain()
    assert f"10 samples on {devices} ranks" in result.stdout
    (padded,) = _floats(r"padded sampler, no join: mean loss ([0-9.]+)", result.stdout)
    (exact,) = _floats(r"with lite.join\(model\): +mean loss ([0-9.]+)", result.stdout)
    (reference,) = _floats(r"one process: +mean loss ([0-9.]+)", result.stdout)
    assert exact == pytest.approx(reference, rel=1e-5), result.stdout
    assert abs(padded - reference) > 0.01 * reference, result.stdout  # padding counts samples twice


@pytest.mark.parametrize("accumulate", [4, 8], ids=["default", "accumulate-8"])
def test_example_accumulate_matches_one_process_on_the_big_batch(example, accumulate):
    args = () if accumulate == 4 else ("--accumulate", "8")
    result = example("accumulate.py", *args)
    assert result.returncode == 0, result.explain()
    assert f"2 process(es), {accumulate} micro-batches of 8 per step" in result.stdout
    assert "gradients stayed local inside no_backward_sync: True" in result.stdout
    (diff,) = _floats(r"max difference from one process on the big batch: ([0-9.e+-]+)", result.stdout)
    assert diff < 1e-5, result.stdout
    losses = _floats(r"step \d+: loss ([0-9.]+)", result.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.1, losses


@pytest.mark.parametrize("args", [(), ("--strategy", "fsdp"), ("--join",)], ids=["ddp", "fsdp", "join"])
def test_example_nanogpt_logs_the_mfu_on_rank_zero_and_learns(example, args):
    result = example("nanogpt.py", *args)
    assert result.returncode == 0, result.explain()
    logged = re.findall(r"^iter (\d+): loss ([0-9.]+), time [0-9.]+ms, mfu (-?[0-9.]+)%$", result.stdout, re.M)
    assert [int(i) for i, _, _ in logged] == list(range(12)), result.stdout  # rank 0 alone, every iteration
    mfu = [float(m) for _, _, m in logged]
    assert mfu[:5] == [-100.0] * 5 and all(m > 0 for m in mfu[5:]), mfu  # estimate_mfu from the 5th on
    losses = [float(loss) for _, loss, _ in logged]
    assert losses[-1] < losses[0] * 0.8, losses
    assert f"2 processes, {'fsdp' if 'fsdp' in args else 'ddp'}: loss" in result.stdout


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize(
    "strategy",
    [
        "fsdp",  # the default: run without --strategy, as the docstring shows
        pytest.param(
            "deepspeed_stage_3",
            marks=[
                pytest.mark.skipif(
                    not _deepspeed_installed(), reason="deepspeed is not installed (pip install scopedlite[deepspeed])"
                ),
                pytest.mark.deepspeed_op,  # its op is built before the tests (conftest.py)
            ],
        ),
    ],
)
def test_example_sharded_trains_saves_and_loads_the_folder_in_one_process(example, tmp_path, strategy):
    args = () if strategy == "fsdp" else ("--strategy", strategy)
    result = example("sharded.py", *args, timeout=110)
    assert result.returncode == 0, result.explain()
    held = {
        int(r): (int(local), int(full))
        for r, local, full in re.findall(r"rank (\d) holds (\d+) of (\d+)", result.stdout)
    }
    assert sorted(held) == [0, 1], result.stdout
    full = held[0][1]
    assert sum(local for local, _ in held.values()) >= full  # together the ranks hold all of it
    assert all(local <= full // 2 + 64 for local, _ in held.values()), held  # each about half (row padding)
    losses = _floats(r"epoch -?\d+: loss ([0-9.]+)", result.stdout)
    assert len(losses) == 5 and losses[-1] < losses[0] * 0.2, losses
    assert (tmp_path / "sharded-ckpt").is_dir()
    loaded, in_run = map(float, re.search(r"loss ([0-9.]+) \(in the run: ([0-9.]+)\)", result.stdout).groups())
    assert loaded == pytest.approx(in_run, rel=1e-4, abs=1e-6), result.stdout


def test_example_resume_stops_on_sigterm_and_continues_where_it_stopped(example, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from conftest import _env

    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "resume.py")],
        env=_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        for line in proc.stdout:  # the launch has started and trains: preempt it
            lines.append(line)
            if line.startswith("step 3"):
                os.kill(proc.pid, signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    first = "".join(lines) + out
    assert proc.returncode == 143, f"exit {proc.returncode}\n{first}\n{err}"  # as a process ended by SIGTERM
    epoch, step = map(int, re.search(r"stopped at epoch (\d+), step (\d+): saved", first).groups())
    assert epoch == 0 and 3 <= step < 24, first
    assert (tmp_path / "resume-ckpt.pt").is_file()

    result = example("resume.py")
    assert result.returncode == 0, result.explain()
    assert f"resumed at epoch {epoch}, step {step}" in result.stdout
    # 512 samples on 2 ranks in batches of 32: 8 steps an epoch, 24 in 3, however it was cut
    steps = [int(s) for s in re.findall(r"^step (\d+)", result.stdout, re.M)]
    assert steps == list(range(step + 1, 25)), result.stdout
    assert "finished after 24 steps on 2 process(es)" in result.stdout
