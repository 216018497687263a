"""The package's layering, checked: imports point down, no cycles, private API fenced.

The layers are declared once, in pyproject.toml's ``[tool.importlinter]`` contract, and drawn
in docs/architecture.md. import-linter checks that no module imports from a layer above its
own; the tests below add what a layers contract does not see: cycles inside a layer, imports
of our own modules hidden inside functions (the usual way a cycle is dodged), and private
torch / DeepSpeed / torch_xla API used outside ``scopedlite._private``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "scopedlite"
PRIVATE = PACKAGE / "_private"
THIRD_PARTY = ("torch", "deepspeed", "torch_xla")


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def test_every_import_points_down():
    """import-linter's layers contract (pyproject.toml) holds."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph("scopedlite", exclude_type_checking_imports=True)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(edges.get(module, ())):
            if seen.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target] if target in path else [module, target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[module] = 2

    for module in sorted(edges):
        if module not in seen:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_of_our_own_modules_inside_functions():
    """A function-level import of scopedlite dodges a cycle: the layering must be fixed instead.

    (Function-level imports of heavy optional parts of torch and of optional extras stay:
    they keep ``import scopedlite`` fast, see docs/architecture.md.)
    """
    found = []
    for path, tree in _modules():
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scopedlite"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} from {node.module}")
                elif isinstance(node, ast.Import) and any(a.name.startswith("scopedlite") for a in node.names):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} import scopedlite...")
    assert not found, found


def _private_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] in THIRD_PARTY and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


# Underscore attributes that are not third-party internals: the standard library's documented
# ones, our own markers on users' objects, and our own classes' attributes.
_ALLOWED_ATTRIBUTES = {
    ("sys", "_getframe"),
    ("sys", "_current_frames"),
    ("os", "_exit"),
    ("options", "_parser"),
    ("options", "_subcommand"),
    ("s", "_state"),
}


def test_private_third_party_api_only_in_the_private_package():
    found = []
    for path, tree in _modules():
        if PRIVATE in path.parents:
            continue
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _private_module(node.module or ""):
                found.append(f"{where}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Import):
                found.extend(f"{where}:{node.lineno} import {a.name}" for a in node.names if _private_module(a.name))
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if (
                    owner in ("self", "cls")
                    or (owner, node.attr) in _ALLOWED_ATTRIBUTES
                    or node.attr.startswith("_lite_")
                ):
                    continue
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


@pytest.mark.parametrize("library", ["torch", "deepspeed", "torch_xla"])
def test_each_private_use_says_why_and_which_version(library):
    path = PRIVATE / f"{library}_internals.py"
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    assert "Checked against" in doc, f"{path.name} must name the version its uses were checked against"
    for func in tree.body:
        if isinstance(func, ast.FunctionDef) and not func.name.startswith("_"):
            assert "Why private" in (ast.get_docstring(func) or ""), (
                f"{path.name}: {func.name} must say why it needs private API"
            )
