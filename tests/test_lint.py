"""The package passes its linter and is formatted as its formatter writes it.

Ruff's settings live in pyproject.toml (``[tool.ruff]``). A failure prints ruff's own report;
``ruff check --fix scopedlite`` and ``ruff format scopedlite`` mend most of it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [["check", "--no-cache", "scopedlite"], ["format", "--check", "--no-cache", "scopedlite"]],
    ids=["check", "format"],
)
def test_the_package_passes_ruff(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}{result.stderr}"
