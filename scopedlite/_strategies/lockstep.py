"""A method that gathers sharded parameters runs on every rank, or is refused before it gathers.

Under FSDP and ZeRO-3 each rank holds a slice of every parameter, and whatever needs them
whole - a forward, or one of the user's methods that computes with them - all-gathers them:
a collective. A method called on some ranks only (``if rank == 0: model.generate(...)``)
gathers alone: its all-gather meets the other ranks' next forward, and the run hangs, aborts,
or silently pairs the wrong tensors from then on.

Asking the other ranks with a collective would hang the same way, so the ranks keep a
*ledger* on the store they already share (the rendezvous key-value store; a write is a few
microseconds and involves no collective). Each rank numbers its gathering steps - forwards of
a set-up sharded model and gathering method calls - and, before each, writes under its own
key the step's number and the number and name of its latest method call. A rank about to
gather for a method then reads the other ranks' keys until each has reached the same step:

- every rank noted the same method at that step: they gather together;
- a rank noted something else there (its next forward, another method): the method is
  refused at once on the ranks that called it, naming it and the ranks, before anything is
  gathered (the ranks still waiting in their own gather end with the run).

What it cannot see: a rank that never reaches another gathering step because it is waiting
in some other collective (a raw ``torch.distributed`` call, the end of the run) - the caller
then waits as it would have without the ledger. A forward only writes; only methods read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from scopedlite._private.torch_internals import default_store

__all__ = ["GatherLedger", "MethodCalledOnSomeRanksError", "Nesting"]

_FORWARD = "forward"


class MethodCalledOnSomeRanksError(RuntimeError):
    """A method that needs the gathered parameters was called on some ranks only."""


class GatherLedger:
    """The ledger of one run's gathering steps (see the module docstring).

    Args:
        store: The key-value store every rank of the run shares.
        rank: This rank.
        world_size: The number of ranks.
        strategy: The strategy's name, for messages.
        hint: The end of the refusal's advice (", or ..."), where the strategy has more.
    """

    def __init__(self, store: Any, rank: int, world_size: int, strategy: str, hint: str = "") -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self.hint = hint
        # One ledger per run on a store that may outlive it (several launch blocks): every rank
        # makes its run's ledger in the same order, so the counter gives the same prefix.
        generation = (int(store.add("scopedlite/ledger/count", 1)) - 1) // world_size
        self.prefix = f"scopedlite/ledger/{generation}"
        self.step = 0
        self.method_step = 0
        self.method_name = ""

    @classmethod
    def of_default_group(cls, strategy: str, hint: str = "") -> GatherLedger:
        return cls(default_store(), dist.get_rank(), dist.get_world_size(), strategy, hint)

    def forward(self) -> None:
        """A forward of a set-up model is about to gather (not one inside a method's call)."""
        self.step += 1
        self._write()

    def method(self, name: str) -> None:
        """The method ``name`` (``"GPT.generate"``) is about to gather: return when every rank
        calls it too, raise :class:`MethodCalledOnSomeRanksError` when some do not."""
        before = self.method_step, self.method_name
        self.step += 1
        self.method_step, self.method_name = self.step, name
        self._write()
        seen = self._wait_for_step()
        callers = sorted(r for r, what in seen.items() if what == name)
        if len(callers) == self.world_size:
            return
        # Nothing was gathered: this rank is still in step with the others, and may go on
        # (e.g. to the forward they went on to) if it catches the error.
        self.step -= 1
        self.method_step, self.method_name = before
        self._write()
        others = "; ".join(
            f"rank {r} went on to the model's forward" if what == _FORWARD else f"rank {r} called {what}() instead"
            for r, what in sorted(seen.items())
            if what != name
        )
        raise MethodCalledOnSomeRanksError(
            f"{name}() needs the parameters gathered from every rank under "
            f"strategy={self.strategy!r}, but only rank(s) {callers} called it ({others}). Call "
            f"it on every rank, as forward is called (e.g. before `if run.is_global_zero:`){self.hint}."
        )

    def close(self) -> None:
        """Let go of the store when the run ends (the strategy's ``stop``).

        Held past the block, the store hosted by rank 0 outlived its run, with its server
        thread: a later launch block in the process (a notebook, a script's second block)
        forks its workers from that process, and the forked workers hung.
        """
        self.store = None

    def _write(self) -> None:
        if self.store is None:
            raise RuntimeError(
                f"The {self.strategy} run this model was set up in has ended: its parameters can no "
                "longer be gathered. Use the model inside its `with lite.launch(...)` block."
            )
        self.store.set(self._key(self.rank), f"{self.step}:{self.method_step}:{self.method_name}")

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _wait_for_step(self) -> dict[int, str]:
        """What each rank does at this rank's current step: a method's name, or "forward"."""
        seen = {self.rank: self.method_name}
        pending = [r for r in range(self.world_size) if r != self.rank]
        pause = 0.0005
        while pending:
            keys = [self._key(r) for r in pending]
            # multi_get would wait, bounded by the store's timeout, for a key not yet written
            values = self.store.multi_get(keys) if self.store.check(keys) else [b""] * len(keys)
            waiting = []
            for r, value in zip(pending, values):
                step, method_step, name = _parse(value)
                if step < self.step:
                    waiting.append(r)
                else:  # reached: its entry for this step is a method only if its latest one is
                    seen[r] = name if method_step == self.step else _FORWARD
            pending = waiting
            if pending:
                time.sleep(pause)
                pause = min(0.02, pause * 2)
        return seen


class Nesting:
    """How deep one set-up model is in its own forwards and methods; each outermost forward is
    noted in ``ledger`` (None: not noted, e.g. an FSDP unit inside the model, or one rank).

    ``enter`` and ``leave`` are its forward pre-hook (prepended: before the strategy's gather)
    and forward hook (``always_call``); a method's call is counted by :meth:`method`.
    """

    def __init__(self, ledger: GatherLedger | None) -> None:
        self.ledger = ledger
        self.depth = 0

    def enter(self, *_: Any) -> None:
        if self.depth == 0 and self.ledger is not None:
            self.ledger.forward()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        self.depth -= 1

    @contextlib.contextmanager
    def method(self) -> Iterator[None]:
        """Count a method's call: a forward inside it is not a gathering step of its own."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def _parse(value: bytes) -> tuple[int, int, str]:
    if not value:
        return 0, 0, ""
    step, method_step, name = value.decode().split(":", 2)
    return int(step), int(method_step), name
