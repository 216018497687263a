"""The public API: every exported name resolves, and importing the package stays lazy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import scopedlite


def test_every_public_name_resolves_to_its_private_module():
    stub = ast.parse((Path(scopedlite.__file__).parent / "__init__.pyi").read_text())
    listed = [a.asname for node in stub.body if isinstance(node, ast.ImportFrom) for a in node.names]
    assert all(a.asname == a.name for node in stub.body if isinstance(node, ast.ImportFrom) for a in node.names)
    assert len(listed) == len(set(listed)), "a public name is listed twice"
    assert sorted(scopedlite.__all__) == sorted(listed)
    for name, module in scopedlite._MODULE_OF.items():
        value = getattr(scopedlite, name)
        assert value.__module__.startswith(module), (name, value.__module__, module)
        assert value.__module__.split(".")[1].startswith("_"), name


def test_dir_shows_each_public_name_once_and_nothing_else():
    shown = dir(scopedlite)
    assert sorted(shown) == sorted(scopedlite.__all__)
    assert len(shown) == len(set(shown))
    for name in scopedlite.__all__:  # resolving names does not add others to dir()
        getattr(scopedlite, name)
    assert sorted(dir(scopedlite)) == sorted(scopedlite.__all__)


def test_spec_names_exist():
    spec = [
        "launch",
        "sharded_init",
        "join",
        "autocast",
        "no_backward_sync",
        "rank_zero_first",
        "setup",
        "setup_module",
        "setup_optimizers",
        "setup_dataloader",
        "backward",
        "clip_gradients",
        "to_device",
        "all_reduce",
        "all_gather",
        "broadcast",
        "barrier",
        "print",
        "seed_everything",
        "save",
        "load",
        "current",
        "DDPStrategy",
        "Run",
    ]
    missing = [n for n in spec if not hasattr(scopedlite, n)]
    assert not missing
    run = scopedlite.current()
    for attr in ("global_rank", "local_rank", "node_rank", "world_size", "device", "is_global_zero"):
        assert hasattr(run, attr)


def test_import_is_lazy():
    code = "import sys, scopedlite; print(sorted(m for m in sys.modules if m.startswith('scopedlite')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['scopedlite']"
