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
