"""SLURM's compressed lists, expanded in pure Python.

SLURM hands every task its node list as ``"node[01-03,7],gpu5"`` and its tasks per node as
``"2(x3),1"``. ``scontrol show hostnames`` expands the first, but calling it costs a process
per rank and needs the SLURM client on the compute node; these few lines need nothing.
"""

from __future__ import annotations

import re

__all__ = ["expand_hostlist", "expand_tasks_per_node"]


def _split_top_level(text: str) -> list[str]:
    """Split on the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Malformed SLURM host list {text!r}: ']' without '['.")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"Malformed SLURM host list {text!r}: '[' without ']'.")
    parts.append(text[start:])
    return parts


def _expand_range(spec: str, whole: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]``; zero padding follows the lower bound."""
    values: list[str] = []
    for item in spec.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"Malformed SLURM host list {whole!r}: bad range {item!r}.")
        if not sep:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"Malformed SLURM host list {whole!r}: range {item!r} runs backwards.")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def _expand_one(pattern: str, whole: str) -> list[str]:
    """Expand one host pattern; several bracket groups give their Cartesian product."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"Malformed SLURM host list {whole!r}.")
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + value + rest for value in _expand_range(match.group(1), whole) for rest in _expand_one(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list, in order: ``"node[01-03,7],gpu5"`` -> 5 host names.

    Raises:
        ValueError: The list is malformed (unbalanced brackets, a bad or backwards range).
    """
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        part = part.strip()
        if part:
            hosts.extend(_expand_one(part, text))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's tasks per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(
                f"Malformed SLURM tasks-per-node list {text!r}: expected items like '2' or '2(x3)', got {item!r}."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
