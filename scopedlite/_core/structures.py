"""Walking nested containers (dicts, lists, tuples, named tuples) of tensors and numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["map_leaves", "map_tensors"]


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
