"""What README.md and examples/ show is run here, as a user would run it."""

from __future__ import annotations

import re

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(120)


def test_example_train_loss_falls(run_python):
    result = run_python(str(REPO / "examples" / "train.py"), "--checkpoint", "final.pt")
    assert result.returncode == 0, result.explain()
    losses = [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3, result.stdout
    assert losses[-1] < losses[0] * 0.5, losses
    assert "2 process(es) on cpu" in result.stdout
    assert result.stdout.count("done in") == 1  # after the block: once


def test_readme_snippet_runs(run_python, tmp_path):
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    prelude = (
        "import torch\n"
        "class Net(torch.nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))\n"
        "data = torch.utils.data.TensorDataset(torch.randn(50, 8), torch.randint(0, 3, (50,)))\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=8)\n"
    )
    script = tmp_path / "readme_example.py"
    script.write_text(prelude + snippet)
    result = run_python(str(script))
    assert result.returncode == 0, result.explain()
    assert (tmp_path / "ckpt.pt").exists()
    # 50 samples on 2 ranks in batches of 8: 4 steps on each rank, printed once each
    assert len([line for line in result.stdout.splitlines() if line.startswith("tensor(")]) == 4


def _floats(pattern: str, text: str) -> list[float]:
    return [float(v) for v in re.findall(pattern, text)]


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_example_eval_uneven_join_gives_the_one_process_mean(run_python, devices):
    # 4 ranks: 3, 3, 2 and 2 samples, so ranks 2-3 reach the all_reduce after the loop while
    # ranks 0-1 still run a forward: the collective waits for them, matched by its line
    result = run_python(str(REPO / "examples" / "eval_uneven.py"), "--devices", str(devices))
    assert result.returncode == 0, result.explain()
    assert f"10 samples on {devices} ranks" in result.stdout
    (padded,) = _floats(r"padded sampler, no join: mean loss ([0-9.]+)", result.stdout)
    (exact,) = _floats(r"with lite.join\(model\): +mean loss ([0-9.]+)", result.stdout)
    (reference,) = _floats(r"one process: +mean loss ([0-9.]+)", result.stdout)
    assert exact == pytest.approx(reference, rel=1e-5), result.stdout
    if 10 % devices:  # padding counts samples twice: the mean must be visibly off
        assert abs(padded - reference) > 0.01 * reference, result.stdout
    else:  # 2 ranks, 5 samples each: nothing to pad
        assert padded == pytest.approx(reference, rel=1e-5), result.stdout


def test_example_accumulate_matches_one_process_on_the_big_batch(run_python):
    result = run_python(str(REPO / "examples" / "accumulate.py"))
    assert result.returncode == 0, result.explain()
    assert "2 process(es), 4 micro-batches of 8 per step" in result.stdout
    assert "gradients stayed local inside no_backward_sync: True" in result.stdout
    (diff,) = _floats(r"max difference from one process on the big batch: ([0-9.e+-]+)", result.stdout)
    assert diff < 1e-5, result.stdout
    losses = _floats(r"step \d+: loss ([0-9.]+)", result.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] * 0.1, losses


def test_example_nanogpt_logs_the_mfu_on_rank_zero_and_learns(run_python):
    result = run_python(str(REPO / "examples" / "nanogpt.py"))
    assert result.returncode == 0, result.explain()
    logged = re.findall(r"^iter (\d+): loss ([0-9.]+), time [0-9.]+ms, mfu (-?[0-9.]+)%$", result.stdout, re.M)
    assert [int(i) for i, _, _ in logged] == list(range(12)), result.stdout  # rank 0 alone, every iteration
    mfu = [float(m) for _, _, m in logged]
    assert mfu[:5] == [-100.0] * 5 and all(m > 0 for m in mfu[5:]), mfu  # estimate_mfu from the 5th on
    losses = [float(loss) for _, loss, _ in logged]
    assert losses[-1] < losses[0] * 0.8, losses
    assert "2 processes, ddp: loss" in result.stdout


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize(
    "strategy",
    [
        "fsdp",
        pytest.param(
            "deepspeed_stage_3",
            marks=[
                pytest.mark.skipif(not _deepspeed_installed(), reason="deepspeed is not installed (pip install scopedlite[deepspeed])"),
                pytest.mark.deepspeed_op,  # its op is built before the tests (conftest.py)
            ],
        ),
    ],
)
def test_example_sharded_trains_saves_and_loads_the_folder_in_one_process(run_python, tmp_path, strategy):
    result = run_python(str(REPO / "examples" / "sharded.py"), "--strategy", strategy, timeout=110)
    assert result.returncode == 0, result.explain()
    held = {int(r): (int(local), int(full)) for r, local, full in re.findall(r"rank (\d) holds (\d+) of (\d+)", result.stdout)}
    assert sorted(held) == [0, 1], result.stdout
    full = held[0][1]
    assert sum(local for local, _ in held.values()) >= full  # together the ranks hold all of it
    assert all(local <= full // 2 + 64 for local, _ in held.values()), held  # each about half (row padding)
    losses = _floats(r"epoch -?\d+: loss ([0-9.]+)", result.stdout)
    assert len(losses) == 5 and losses[-1] < losses[0] * 0.2, losses
    assert (tmp_path / "sharded-ckpt").is_dir()
    loaded, in_run = map(float, re.search(r"loss ([0-9.]+) \(in the run: ([0-9.]+)\)", result.stdout).groups())
    assert loaded == pytest.approx(in_run, rel=1e-4, abs=1e-6), result.stdout


def test_example_resume_stops_on_sigterm_and_continues_where_it_stopped(run_python, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from conftest import _env

    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "resume.py")],
        env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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

    result = run_python(str(REPO / "examples" / "resume.py"))
    assert result.returncode == 0, result.explain()
    assert f"resumed at epoch {epoch}, step {step}" in result.stdout
    # 512 samples on 2 ranks in batches of 32: 8 steps an epoch, 24 in 3, however it was cut
    steps = [int(s) for s in re.findall(r"^step (\d+)", result.stdout, re.M)]
    assert steps == list(range(step + 1, 25)), result.stdout
    assert "finished after 24 steps on 2 process(es)" in result.stdout
