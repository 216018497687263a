"""scopedlite: scale an unchanged PyTorch training loop by wrapping it in scopes.

Layers, each importing only the ones below it (checked by ``tests/test_architecture.py``
with import-linter; see ``docs/architecture.md``)::

    scopedlite (this file), _cli    public names, the command line
    _api                            the functions users call: setup, join, save, ...
    _launch                         the launch scope, its roles, workers, supervision
    _plan                           the pure resolver: arguments -> frozen Plan
    _strategies                     one class per strategy, abilities as protocols
    _io | _comm | _loggers          checkpoint files; process groups and the wire format; metrics
    _cluster | _hardware            which world this process is in; what the machine has
    _private                        fenced private API of torch, DeepSpeed, torch_xla
    _core                           scopes, Run/Placement, precision; imports nothing else

Every public name is written once, in ``__init__.pyi`` beside this file (``from .module
import name as name``). This module reads that stub to build ``__all__``, ``__dir__`` and a
lazy ``__getattr__`` (PEP 562), so ``import scopedlite`` costs next to nothing beyond torch
and each name's module is imported on first use.
"""

from __future__ import annotations

import ast as _ast
import importlib as _importlib
import os as _os
from pathlib import Path as _Path
from typing import Any as _Any

__version__ = "0.1.0"

try:  # where the program started: a re-executed worker starts there (scopedlite._launch.start)
    _START_DIRECTORY: str | None = _os.getcwd()
except OSError:
    _START_DIRECTORY = None


def _read_stub() -> dict[str, str]:
    """public name -> the module defining it, from the ``from .x import y as y`` lines."""
    tree = _ast.parse((_Path(__file__).parent / "__init__.pyi").read_text())
    return {
        alias.asname or alias.name: f"{__name__}.{node.module}"
        for node in tree.body
        if isinstance(node, _ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
    }


_MODULE_OF = _read_stub()
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> _Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'scopedlite' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return list(__all__)
