"""The package's layering, checked: imports point down, no cycles, private API fenced.

The layers are declared once, in pyproject.toml's ``[tool.importlinter]`` contract, and drawn
in docs/architecture.md. import-linter checks that no module imports from a layer above its
own; the tests below add what a layers contract does not see: cycles inside a layer, imports
of our own modules hidden inside functions (the usual way a cycle is dodged), and private
torch / DeepSpeed / torch_xla API used outside ``scopedlite._private``: as ``x._attr``, by a
string (``vars(m)["_modules"]``, ``getattr(x, "_y")``), or as one of the attributes those
libraries set for their own bookkeeping without an underscore.
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


# Attributes of torch's and DeepSpeed's objects that are not underscored but not documented
# either: plain attributes the library sets and reads for its own bookkeeping. Read or written
# (``x.name``, ``getattr(x, "name")``) only in ``scopedlite._private``.
_UNDOCUMENTED_ATTRIBUTES = {
    # DistributedDataParallel: what no_sync() and the forward set, the ignored names' set
    "require_backward_grad_sync",
    "require_forward_param_sync",
    "parameters_to_ignore",
    # DeepSpeed: what ZeRO-3 (deepspeed.zero.Init) adds to a partitioned parameter
    "ds_numel",
    "ds_id",
    "ds_status",
    "ds_tensor",
    "ds_shape",
    "ds_process_group",
    "ds_persist",
    "ds_active_sub_modules",
}

# Underscore names reached by string (getattr/hasattr/setattr/delattr, ``__dict__[...]``) that
# are not third-party internals: (the object as written, the name) -> why it is allowed.
_ALLOWED_BY_NAME = {
    ("data", "_fields"): "a named tuple's _fields is documented API (collections.namedtuple)",
    ("samplers[0]", "_drop_last"): "our own sampler's attribute (scopedlite/_api/sampler.py)",
    ("package", "_START_DIRECTORY"): "our own package's module constant (scopedlite/__init__.py)",
}

_GETATTR_FAMILY = ("getattr", "setattr", "hasattr", "delattr")
_DUNDER_ACCESS = ("__getattribute__", "__setattr__", "__delattr__")  # object.__getattribute__(x, "name")


def _internal_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _loop_constants(tree: ast.Module) -> dict[str, set[str]]:
    """For each name bound by a loop over a literal of strings (``for store in ("_a", "_b")``,
    also in comprehensions), the strings it takes."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.For, ast.comprehension))
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, (ast.Tuple, ast.List, ast.Set))
        ):
            values = {e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            found.setdefault(node.target.id, set()).update(values)
    return found


def _instance_dict_of(node: ast.AST, aliases: set[str]) -> ast.AST | None:
    """The object whose attribute dictionary ``node`` is (``x.__dict__``, ``vars(x)``, or a
    name assigned one of those), else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        return node.args[0]
    if isinstance(node, ast.Name) and node.id in aliases:
        return node
    return None


def _by_name_accesses(tree: ast.Module) -> list[tuple[ast.AST, ast.AST, str, bool]]:
    """``(the whole expression, the object, the attribute name, through its dictionary)`` for
    each attribute reached by a string: an instance dictionary's key (subscript,
    ``get``/``pop``/``setdefault``, ``in``) or the name given to getattr, setattr, hasattr,
    delattr or an ``object.__getattribute__``-style call. A key that is a loop variable over a
    literal of strings counts as each of them."""
    loops = _loop_constants(tree)
    aliases = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _instance_dict_of(node.value, set()) is not None
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def names(key: ast.AST) -> set[str]:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return {key.value}
        if isinstance(key, ast.Name):
            return loops.get(key.id, set())
        return set()

    found = []
    for node in ast.walk(tree):
        owner = key = None
        through_dict = True
        if isinstance(node, ast.Subscript):
            owner, key = _instance_dict_of(node.value, aliases), node.slice
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            owner, key = _instance_dict_of(node.comparators[0], aliases), node.left
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault"):
                owner, key = _instance_dict_of(func.value, aliases), node.args[0]
            elif len(node.args) >= 2 and (
                (isinstance(func, ast.Name) and func.id in _GETATTR_FAMILY)
                or (isinstance(func, ast.Attribute) and func.attr in _DUNDER_ACCESS)
            ):
                owner, key, through_dict = node.args[0], node.args[1], False
        if owner is not None and key is not None:
            found.extend((node, owner, name, through_dict) for name in sorted(names(key)))
    return found


def test_private_third_party_api_by_name_only_in_the_private_package():
    """What ``x._attr`` does not show: a third party's internals reached by a string
    (``vars(module)["_modules"]``, ``getattr(x, "_y")``), and attributes torch and DeepSpeed
    set for their own bookkeeping without an underscore (``ddp.require_backward_grad_sync``,
    ``param.ds_numel``). Either goes through a function of ``scopedlite._private``."""
    found = []
    for path, tree in _modules():
        if PRIVATE in path.parents:
            continue
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in _UNDOCUMENTED_ATTRIBUTES:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
        for node, owner, name, through_dict in _by_name_accesses(tree):
            written = ast.unparse(owner)
            if name not in _UNDOCUMENTED_ATTRIBUTES and (
                not _internal_name(name)
                or name.startswith("_lite_")
                or (written, name) in _ALLOWED_BY_NAME
                # getattr(self, "_x") is our own class's attribute, as self._x is; but
                # self.__dict__["_modules"] is still torch's, on a subclass of nn.Module
                or (written in ("self", "cls") and not through_dict)
            ):
                continue
            found.append(f"{where}:{node.lineno} {name!r} in {ast.unparse(node)}")
    assert not found, sorted(found)


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
