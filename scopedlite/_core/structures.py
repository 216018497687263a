"""Walking nested containers (dicts, lists, tuples, named tuples) of tensors and numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["map_leaves", "map_tensors", "structure_of"]


def map_leaves(data: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """Rebuild ``data`` with ``fn`` applied to every leaf for which ``is_leaf`` is true.

    Containers are walked in a fixed order (insertion order for mappings), so the same
    structure gives the same sequence of leaves on every rank: collectives issued per leaf
    therefore match across ranks.
    """
    if is_leaf(data):
        return fn(data)
    if isinstance(data, Mapping):
        items = {k: map_leaves(v, fn, is_leaf) for k, v in data.items()}
        return items if type(data) is dict else type(data)(items)  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # named tuple
        return type(data)(*(map_leaves(v, fn, is_leaf) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_leaves(v, fn, is_leaf) for v in data)
    return data


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in ``data``; other leaves are returned unchanged."""
    return map_leaves(data, fn, lambda x: isinstance(x, torch.Tensor))


def structure_of(data: Any, is_leaf: Callable[[Any], bool]) -> str:
    """The shape of the nest around ``data``'s leaves, as text that is the same on every rank
    for the same structure: containers, their keys and the order :func:`map_leaves` walks them
    in, with ``*`` for each leaf. Two ranks passing dicts with the same keys in another order
    differ here, since their leaves would pair up wrongly in a collective issued per leaf.
    Keys other than strings, numbers and None appear as their type (their ``repr`` may hold a
    memory address, which differs between processes)."""
    if is_leaf(data):
        return "*"
    if isinstance(data, Mapping):
        inner = ", ".join(f"{_key(k)}: {structure_of(v, is_leaf)}" for k, v in data.items())
        return f"{{{inner}}}"
    if isinstance(data, (list, tuple)):
        inner = ", ".join(structure_of(v, is_leaf) for v in data)
        if isinstance(data, tuple) and hasattr(data, "_fields"):
            return f"{type(data).__name__}({inner})"
        return f"[{inner}]" if isinstance(data, list) else f"({inner})"
    return type(data).__name__  # passed through unchanged


def _key(key: Any) -> str:
    return repr(key) if key is None or isinstance(key, (str, int, float)) else type(key).__qualname__
