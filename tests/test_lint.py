"""The package, the tests, the examples and the benchmarks pass the linter and are formatted as
the formatter writes them.

Ruff's settings live in pyproject.toml (``[tool.ruff]``), the same for every folder. A failure
prints ruff's own report; ``ruff check --fix FOLDER`` and ``ruff format FOLDER`` mend most of it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FOLDERS = ["scopedlite", "tests", "examples", "benchmarks"]


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize(
    "command", [["check", "--no-cache"], ["format", "--check", "--no-cache"]], ids=["check", "format"]
)
def test_the_code_passes_ruff(command, folder):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, folder], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff {' '.join(command)} {folder}:\n{result.stdout}{result.stderr}"
