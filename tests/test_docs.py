"""Code shown in README.md and docs/ stays true: it parses and names only real public API."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

import scopedlite
from conftest import REPO

PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
BLOCKS = [
    pytest.param(block, id=f"{page.name}-{i}")
    for page in PAGES
    for i, block in enumerate(
        textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)^[ \t]*```", page.read_text(), re.S | re.M)
    )
]


@pytest.mark.parametrize("block", BLOCKS)
def test_python_blocks_parse_and_use_real_names(block):
    tree = ast.parse(block)
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "lite"
    }
    missing = sorted(name for name in used if not hasattr(scopedlite, name))
    assert not missing, f"docs use lite.{missing}, which scopedlite does not export"


def test_there_are_blocks_to_check():
    assert len(BLOCKS) > 10


def test_docs_site_builds_with_warnings_as_errors(tmp_path):
    import os
    import subprocess
    import sys

    pytest.importorskip("mkdocs", reason="the docs tooling (pip install scopedlite[docs]) is not installed")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()
