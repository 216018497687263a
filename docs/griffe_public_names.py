"""A griffe extension for the API reference: the names in ``scopedlite/__init__.pyi`` are public.

The package lists each public name once, in its stub, as ``from .module import name as name``
(``__all__`` is built from the stub at import time, so griffe cannot read it statically).
Griffe treats imported names as private unless told otherwise; this tells it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import griffe

STUB = Path(__file__).resolve().parent.parent / "scopedlite" / "__init__.pyi"


class PublicStubNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "scopedlite":
            return
        tree = ast.parse(STUB.read_text())
        names = {
            alias.asname or alias.name
            for node in tree.body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        for name in names:
            if name in pkg.members:
                pkg.members[name].public = True
