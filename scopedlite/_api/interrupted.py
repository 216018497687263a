"""What is left of a pass that a run of another world size had begun (see ``loader_state``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Interrupted"]


@dataclass(frozen=True)
class Interrupted:
    """The part of a pass's order that the ranks of a run of another size had taken.

    Old rank ``r`` of ``world_size`` read positions ``r, r + w, r + 2w, ...`` of the pass's
    order, padded (outside ``lite.join``) or not, and had taken the first ``taken[r]`` of
    them. ``before`` is the same record for a pass that was itself a resumed one, whose order
    was already the remainder of an earlier run's.
    """

    world_size: int
    taken: tuple[int, ...]
    padded: bool
    drop_last: bool
    before: Interrupted | None = None

    def remaining(self, n: int) -> list[int]:
        """The positions (of an order of ``n`` items) that no old rank took, in order."""
        base = self.before.remaining(n) if self.before is not None else list(range(n))
        m, w = len(base), self.world_size
        if self.padded and self.drop_last:
            limit = total = m // w * w
        elif self.padded:
            limit, total = m, math.ceil(m / w) * w
        else:
            limit = total = m
        taken: set[int] = set()
        for rank, count in enumerate(self.taken):
            for position in range(rank, total, w)[:count]:
                taken.add(position % m)
        return [base[p] for p in range(limit) if p not in taken]

    def to_state(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "taken": list(self.taken),
            "padded": self.padded,
            "drop_last": self.drop_last,
            "before": self.before.to_state() if self.before is not None else None,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Interrupted | None:
        if state is None:
            return None
        return cls(
            int(state["world_size"]),
            tuple(int(t) for t in state["taken"]),
            bool(state["padded"]),
            bool(state["drop_last"]),
            cls.from_state(state["before"]),
        )
