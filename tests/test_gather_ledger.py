"""The gather ledger's reading of another rank that has run ahead (``_strategies/lockstep.py``).

Two ledgers of a two-rank run share one real ``torch.distributed.HashStore`` in this process,
each driven by its own thread as each rank drives its own. Rank 0 sees the store through a
view that hides rank 1's line until the test lets it look: the interleaving that made
``examples/sharded.py`` under ZeRO-3 fail in CI (rank 1's forwards gather nothing, its
parameters being persistent, so it passed an evaluation together with rank 0 and reached its
next one before rank 0 had read the line of the first) is made on every run here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from scopedlite._strategies.lockstep import ForwardOnSomeRanksError, GatherLedger

pytestmark = pytest.mark.timeout(60)


class _LateSight:
    """A store as rank 0 sees it: rank 1's line is not there until ``look`` is set."""

    def __init__(self, store: dist.Store, hidden: str) -> None:
        self.store, self.hidden, self.look = store, hidden, threading.Event()

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, value)

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return (self.look.is_set() or self.hidden not in keys) and self.store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.store.multi_get(keys)


def _ledgers() -> tuple[GatherLedger, GatherLedger, _LateSight]:
    store = dist.HashStore()
    view = _LateSight(store, "")
    rank0 = GatherLedger(view, 0, 2, "deepspeed_stage_3", timeout=20)
    rank1 = GatherLedger(store, 1, 2, "deepspeed_stage_3", timeout=20)
    view.hidden = rank1._key(1)
    return rank0, rank1, view


class _Rank(threading.Thread):
    """Run ``steps`` (calls on one ledger) in order; what each returned or raised is kept."""

    def __init__(self, steps: list[Callable[[], Any]]) -> None:
        super().__init__(daemon=True)
        self.steps, self.outcomes, self.done = steps, [], threading.Event()

    def run(self) -> None:
        for step in self.steps:
            try:
                self.outcomes.append(step())
            except Exception as error:  # noqa: BLE001 - the outcome the test asserts
                self.outcomes.append(error)
            self.done.set()

    def wait_for(self, n: int) -> None:
        for _ in range(400):
            if len(self.outcomes) >= n:
                return
            self.done.wait(0.05)
            self.done.clear()
        raise AssertionError(f"the rank made {len(self.outcomes)} of {n} steps: {self.outcomes}")


def test_a_rank_that_passed_an_evaluation_and_waits_in_the_next_is_met_not_refused():
    rank0, rank1, view = _ledgers()
    zero = _Rank([lambda: rank0.forward(evaluating=True), lambda: rank0.forward(evaluating=True)])
    zero.start()
    one = _Rank([lambda: rank1.forward(evaluating=True), lambda: rank1.forward(evaluating=True), rank1.collective])
    one.start()
    one.wait_for(1)  # rank 1 saw rank 0 at the first evaluation and passed it
    assert one.outcomes == [None]
    assert rank1.step == 2  # now waiting in the second: its line says step 2, rank 0 has not read it
    view.look.set()
    zero.wait_for(2)
    one.wait_for(3)
    assert zero.outcomes == [None, None], zero.outcomes  # the old ledger took step 2 here, then refused
    assert one.outcomes == [None, None, None], one.outcomes
    assert rank0.step == rank1.step == 2


def test_a_rank_that_trained_at_this_step_and_went_on_to_an_evaluation_is_refused():
    rank0, rank1, view = _ledgers()
    view.look.set()
    zero = _Rank([lambda: rank0.forward(evaluating=True)])  # rank 0 alone evaluates at step 1
    one = _Rank([lambda: rank1.forward(evaluating=False), lambda: rank1.forward(evaluating=True)])
    one.start()
    one.wait_for(1)  # rank 1 trained at step 1; it now waits at an evaluation at step 2
    zero.start()
    zero.wait_for(1)
    (refusal,) = zero.outcomes
    assert isinstance(refusal, ForwardOnSomeRanksError), refusal
    assert "rank(s) [0] only (rank 1 went on to the model's forward)" in str(refusal)
    assert rank0.step == 0  # taken back: rank 0 may still go on to the forward rank 1 ran
    # It does: a training forward (step 1) and then the evaluation rank 1 waits in (step 2).
    rank0.forward(evaluating=False)
    rank0.forward(evaluating=True)
    one.wait_for(2)
    assert one.outcomes == [None, None], one.outcomes
