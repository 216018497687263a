"""A forward or method that gathers sharded parameters runs on every rank, or is refused
before it gathers.

Under FSDP, ZeRO-3 and model_parallel each rank holds a slice of every parameter, and whatever
needs them whole - a forward, or one of the user's methods that computes with them -
all-gathers them: a collective. A forward or method run on some ranks only (``if rank == 0:
evaluate(model)``, ``model.generate(...)``) gathers alone: its all-gather meets the other
ranks' next forward, or nothing at all, and the run hangs, aborts, or silently pairs the wrong
tensors from then on.

Asking the other ranks with a collective would hang the same way, so the ranks keep a
*ledger* on the store they already share (the rendezvous key-value store; a write is a few
microseconds and involves no collective). Each rank numbers its gathering steps - forwards of
a set-up sharded model and gathering method calls - and, before each, writes under its own
key the step's number, what it is (a training forward, an evaluation forward, a method's
name), how many of our collectives (``lite.barrier()``, ``lite.all_reduce``, ...) it has
entered, and whether it has reached the end of its launch block. A rank about to gather for
a method or an evaluation forward (grad disabled or the model in ``eval()``) then reads the
other ranks' keys until each has reached the same step, or cannot reach it. A line keeps its
rank's last two checked steps: a rank whose forward gathers nothing (ZeRO-3's persistent
parameters) passes a step with the others and can note its next before a slower rank has
read the first; the slower one finds the step it waits at one back:

- every rank noted the same thing at that step: they gather together;
- a rank noted something else there (a training forward, another method), entered a
  collective of ours this rank has not, or reached the end of its launch block: the step is
  refused at once on the ranks that called it, naming what each rank does and the fix,
  before anything is gathered (the ranks still waiting in their own gather end with the run).

A training forward (grad enabled, model in ``train()``) only writes: every rank runs it, and
reading there would cost each step a wait on the slowest rank. DeepSpeed's engine step, a
collective every rank takes, is noted the same way (:meth:`GatherLedger.optimizer_step`). What
the ledger cannot see: a rank waiting in a raw ``torch.distributed`` call; the caller then
waits in its poll, which the hang watchdog counts as a wait (``_launch/stall.py``) and ends
after its window or a SIGTERM's grace; else the run's collective timeout raises
``TimeoutError`` naming the ranks that never came.

A step whose backward one rank skipped (``if not torch.isfinite(loss): continue`` on one
rank) is seen the same way. Each rank also counts its training forwards and its backwards
(``lite.backward``, outside ``lite.join``) and notes, with each backward, how many forwards
came before it: the same numbers on every rank of a program that runs the same steps. A
training forward that follows another with no backward between (a skipped backward, or a
GAN's second discriminator forward) reads the others' lines and waits until each rank has run
this forward too, or is found to have started the next backward after fewer forwards: the
skip. That rank's gathers would meet the other ranks' backward, and the run would hang until
the watchdog; it is refused there, naming the fix (``skipped_step.py``). The others wait in
that backward's collectives, so the refusal ends the run. A loop with one forward per
backward never reads; a script whose backwards are not ``lite.backward`` is not checked.

Under ddp and ZeRO-0/1/2 (``gathers=False``) a forward gathers nothing: the ledger notes only
the training forwards (those strategies compare them at the backward), so that the calls
every rank makes together (``lite.save``, ``lite.load``, ``lite.setup``,
``lite.setup_dataloader``: ``_api/every_rank.py``) are refused at once on some ranks there
too (:meth:`GatherLedger.every_rank_calls`). Inside ``lite.join`` nothing is noted, and each
block starts a new epoch however it ends (:meth:`GatherLedger.inside_join`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from scopedlite._private.torch_internals import default_store
from scopedlite._strategies.join.members import in_join, refuse_gather_in_join
from scopedlite._strategies.skipped_step import forward_past_backward

__all__ = [
    "ForwardOnSomeRanksError",
    "GatherLedger",
    "MethodCalledOnSomeRanksError",
    "Nesting",
    "every_rank_calls",
    "gathering_together",
]

_FORWARD = "forward"  # a training forward: written, never checked
EVALUATION = "an evaluation forward"  # grad disabled or the model in eval(): checked
_ENDED = "\x00ended"  # what a rank at the end of its launch block does at every later step
_IN_COLLECTIVE = "\x00collective"  # a rank in a collective of ours the reader has not entered
_OPTIMIZER_STEP = "\x00step"  # a collective optimizer step (DeepSpeed's engine step): written, never read
_NAMES = "\x1f"  # between the two names of a ledger entry (a method's name may hold ":")


class MethodCalledOnSomeRanksError(RuntimeError):
    """A method that needs the gathered parameters was called on some ranks only."""


class CollectiveOnSomeRanksError(MethodCalledOnSomeRanksError):
    """A collective of ours was called on some ranks only: a rank would wait in it for ranks
    that went on past it."""


class ForwardOnSomeRanksError(MethodCalledOnSomeRanksError):
    """A forward of a sharded model (an evaluation, say) was run on some ranks only."""


class GatherLedger:
    """The ledger of one run's gathering steps (see the module docstring).

    Args:
        store: The key-value store every rank of the run shares.
        rank: This rank.
        world_size: The number of ranks.
        strategy: The strategy's name, for messages.
        hint: The end of the refusal's advice (", or ..."), where the strategy has more.
        full_weights: The expression that gives every rank the model's full weights under
            this strategy (the way to a plain copy for one rank).
        timeout: How long (seconds) a rank waits for the others to reach its step.
        gathers: Whether the strategy's forwards gather parameters (fsdp, model_parallel,
            ZeRO-3). Where they do not (ddp, ZeRO-1/2) the strategy notes only its training
            forwards, and the ledger serves :meth:`every_rank_calls` alone: no skipped backward
            is looked for (those strategies compare at the backward, ``skipped_step.py``).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        strategy: str,
        hint: str = "",
        full_weights: str = "model.state_dict()",
        timeout: float = 1800.0,
        gathers: bool = True,
    ) -> None:
        self.store = store
        self.gathers = gathers
        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self.hint = hint
        self.full_weights = full_weights
        self.timeout = timeout
        # One ledger per run on a store that may outlive it (several launch blocks): every rank
        # makes its run's ledger in the same order, so the counter gives the same prefix.
        generation = (int(store.add("scopedlite/ledger/count", 1)) - 1) // world_size
        self.prefix = f"scopedlite/ledger/{generation}"
        self.step = 0
        # This rank's last two checked steps, latest first: (number, what). A reader at step
        # S finds another rank at a later step S' > S when that rank passed S together with
        # it and went on, possibly to its next checked step (a forward that gathers nothing,
        # ZeRO-3's persistent parameters, lets it run ahead); what it did at S is then the
        # earlier of the two. It cannot have passed a checked step after S without this rank.
        self.checked: tuple[tuple[int, str], tuple[int, str]] = ((0, ""), (0, ""))
        self.collectives = 0  # collectives of ours entered
        # Training forwards and backwards (lite.backward) outside lite.join, this epoch, and how
        # many forwards came before the latest backward: what a skipped backward changes.
        self.forwards = self.backwards = self.forwards_at_backward = 0
        self.ended = False  # the end of the launch block reached
        self.broken = ""  # a skipped backward's refusal: no later step of this rank goes on
        self.epoch = 0  # lite.join blocks left: each starts the counts again, on every rank
        self._end_reads = (0.0, 0.0)  # when this rank reached its block's end, when it last read there
        self._all_written = False  # every other rank's line was seen on the store

    @classmethod
    def of_default_group(
        cls,
        strategy: str,
        hint: str = "",
        full_weights: str = "model.state_dict()",
        timeout: float = 1800.0,
        gathers: bool = True,
    ) -> GatherLedger:
        return cls(
            default_store(), dist.get_rank(), dist.get_world_size(), strategy, hint, full_weights, timeout, gathers
        )

    def forward(self, evaluating: bool = False, joined: bool = False) -> None:
        """A forward of a set-up model is about to gather (not one inside a method's call).

        A training forward is only noted; a second one since this rank's last backward is
        also checked for a skipped backward (see the module docstring). An evaluation forward
        (``evaluating``: grad disabled or the model in ``eval()``, what a rank alone typically
        runs) returns when every rank runs one too, and raises
        :class:`ForwardOnSomeRanksError` when some do not. Inside ``lite.join`` (``joined``)
        nothing is noted: the join protocol keeps the ranks in step there (a rank out of data
        replays the others' forwards), and the counts stay those of before the block on every
        rank, however it ends (a refusal on some ranks, an exception).
        """
        if joined:
            return
        if not evaluating:
            self.step += 1
            self.forwards += 1
            self._write()
            if self.gathers and self.backwards and self.forwards - self.forwards_at_backward > 1:
                self._check_backward_taken()
            return
        callers, seen = self._together(EVALUATION)
        if callers is None:
            return
        raise ForwardOnSomeRanksError(
            f"A forward of the set-up model in evaluation (torch.no_grad() or model.eval()) ran on "
            f"rank(s) {callers} only ({_others(seen, EVALUATION)}), under strategy={self.strategy!r}, "
            "where every rank holds a shard of the parameters and a forward gathers them from "
            "every rank: alone it would wait forever. Evaluate on every rank (for data that "
            "does not split evenly, over a set-up loader inside `with lite.join(model), "
            "torch.no_grad():`, which sees each sample once, then `lite.all_reduce` the metric), "
            f"or give rank 0 a plain copy: `weights = {self.full_weights}` on every rank (it "
            "gathers), then on rank 0 alone `copy = MyModel(); copy.load_state_dict(weights)` "
            "and evaluate `copy`."
        )

    def method(self, name: str) -> None:
        """The method ``name`` (``"GPT.generate"``) is about to gather: return when every rank
        calls it too, raise :class:`MethodCalledOnSomeRanksError` when some do not."""
        callers, seen = self._together(name)
        if callers is None:
            return
        raise MethodCalledOnSomeRanksError(
            f"{name}() needs the parameters gathered from every rank under "
            f"strategy={self.strategy!r}, but only rank(s) {callers} called it ({_others(seen, name)}). "
            f"Call it on every rank, as forward is called (e.g. before `if run.is_global_zero:`){self.hint}."
        )

    def every_rank_calls(self, call: str, why: str, fix: str, alone: str | None = None) -> None:
        """``call`` (``"lite.save"``), which every rank makes together, is about to run its
        first collective: return when every rank makes it too, raise
        :class:`MethodCalledOnSomeRanksError` when some do not (``why``: what every rank does
        in it; ``fix``: the way out; ``alone``: what a call on some ranks would do, where it
        is not to wait for the others' next step)."""
        callers, seen = self._together(call)
        if callers is None:
            return
        alone = alone or "alone it would wait for the others' collective, which is their next step's"
        raise MethodCalledOnSomeRanksError(
            f"{call}() was called on rank(s) {callers} only ({_others(seen, call)}), under "
            f"strategy={self.strategy!r}: every rank takes part in it ({why}), so {alone}. {fix}"
        )

    def whole_value(self, call: str) -> None:
        """``call`` (``"float() of a DTensor (_NormPartial(2))"``) is about to read the whole
        value of a tensor each rank holds part of (``fsdp/whole_numbers.py``): return when
        every rank reads one too, raise :class:`MethodCalledOnSomeRanksError` when some do not."""
        callers, seen = self._together(call)
        if callers is None:
            return
        raise MethodCalledOnSomeRanksError(
            f"{call} was read on rank(s) {callers} only ({_others(seen, call)}), under "
            f"strategy={self.strategy!r}: each rank holds part of that value (a norm or a sum "
            "of sharded parameters or gradients is this rank's part, a sharded tensor its "
            "rows), and its whole value needs every rank's part, so alone it would wait for "
            "ever. Read it on every rank (before `if run.is_global_zero:`), then use the number "
            "on one: `norm = float(p.norm())` everywhere, `if run.is_global_zero: print(norm)`."
        )

    def optimizer_step(self) -> None:
        """This rank takes a collective optimizer step (DeepSpeed's engine step: ZeRO gathers
        the updated partitions) that every rank takes: noted as a step of its own, never read
        (a rank that calls something alone learns that this one waits in that step, where
        its training forward never comes). Every rank then waits in the step's collectives
        for the others, so no rank gets two of its checked steps past another's."""
        self.step += 1
        self.checked = ((self.step, _OPTIMIZER_STEP), self.checked[0])
        self._write()

    def dtensor_collective(self, name: str, where: str) -> None:
        """A collective over DTensors (torch's functional ``name``) that the user's code at
        ``where`` started is about to reach every rank (``fsdp/dtensor_collectives.py``): return
        when every rank starts one too, raise :class:`MethodCalledOnSomeRanksError` when some
        do not."""
        what = f"a DTensor collective ({name})"
        callers, seen = self._together(what)
        if callers is None:
            return
        raise MethodCalledOnSomeRanksError(
            f"{what[0].upper()}{what[1:]}, started at {where}, ran on rank(s) {callers} only ({_others(seen, what)}), "
            f"under strategy={self.strategy!r}: it combines every rank's part of sharded values "
            "(a norm of sharded gradients, as torch.nn.utils.clip_grad_norm_ takes it, a "
            "parameter's full_tensor(), a redistribution), so alone it would wait for ever. Run "
            "it on every rank (before `if run.is_global_zero:`), then use the result on one: "
            "`norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` everywhere, "
            "`if run.is_global_zero: print(norm)`."
        )

    def backward(self) -> None:
        """This rank starts a backward (``lite.backward``, outside ``lite.join``): noted for the
        forwards that follow; no read, no wait."""
        self.backwards += 1
        self.forwards_at_backward = self.forwards
        self._write()

    def _check_backward_taken(self) -> None:
        """This rank runs a second training forward since its last backward: return when
        every rank runs it too; raise where the ranks' forwards and backwards no longer pair
        (a rank skipped a backward the others took), or a rank ended its block or waits in a
        collective of ours (this forward would gather alone). Once raised, every later step of
        this rank's ledger raises it again: the others wait in their backward's collectives,
        and a rank that caught it would meet them with its next collective."""
        seen = self._poll(
            lambda entry: self._pairing(entry) if entry.epoch == self.epoch else None,
            "A training forward",
            "to run it too, or a backward",
        )
        elsewhere = {r: done for r, done in seen.items() if done}
        if elsewhere:
            error = forward_past_backward(
                self.forwards, self.forwards - self.forwards_at_backward, elsewhere, self.strategy
            )
            self.broken = str(error)
            raise error

    def _pairing(self, entry: _Entry) -> str | None:
        """Whether another rank's line (of this epoch) pairs with this rank's current training
        forward: ``""`` it does (the rank ran it too, before the same backward), what it did
        instead where it cannot, None while it cannot tell yet."""
        if entry.backwards == self.backwards + 1 and entry.forwards_at_backward < self.forwards:
            return f"started its backward {entry.backwards} after {entry.forwards_at_backward} training forwards"
        if entry.backwards > self.backwards or (entry.backwards == self.backwards and entry.forwards >= self.forwards):
            return ""
        if entry.backwards == self.backwards - 1 and entry.forwards > self.forwards_at_backward:
            return (
                f"ran {entry.forwards} training forwards without backward {self.backwards}, which this "
                f"rank started after {self.forwards_at_backward}"
            )
        if entry.ended:
            return _words(_ENDED)
        if entry.collectives > self.collectives:
            return _words(_IN_COLLECTIVE)
        return None

    def users_collective(self, call: str) -> None:
        """``call`` (``"lite.all_reduce"``), a collective of ours that the script called
        outside ``lite.join``, is about to run. Noted as :meth:`collective` (a rank about to
        gather alone sees this one in a collective, is refused and comes back), then it
        returns once every other rank has entered it too, or raises
        :class:`CollectiveOnSomeRanksError` where one went on past it: to a later training
        forward, or to the end of its block. This rank then calls one more collective of
        ours than that rank. Alone it would wait there until the timeout, or meet that rank's
        gradient reduction or gathers (gloo aborts; NCCL hangs). Often the extra call came
        earlier: a collective inside ``if run.is_global_zero:`` met another rank's next call
        of the same shape through the same lines (a loop run once more on one rank: calls from
        different lines, or through different callers, are refused by their shape check,
        ``_comm/signature.py``), which both took for theirs,
        and this is the first call after it that can be told."""
        self.collective()

        def settle(entry: _Entry) -> str | None:
            if entry.epoch < self.epoch:
                return None  # it has not left the lite.join block this rank left: it will
            if entry.collectives >= self.collectives:
                # it entered this collective: where it went after (a broadcast's receiver
                # is done once the source has sent) is no concern of this one
                return ""
            if entry.epoch > self.epoch:
                return "went on past a lite.join block"
            if entry.forwards > self.forwards:
                return _forward_past(entry.forwards, self.forwards)
            return _words(_ENDED) if entry.ended else None

        # Starts fast (the others usually arrive within a millisecond) and backs off to
        # 0.25 s: ranks that wait in lite.barrier() while rank 0 works alone for minutes
        # (lite.rank_zero_first) read rank 0's store at most four times a second each.
        seen = self._poll(settle, call, "to call it too", first_pause=0.0001, last_pause=0.25)
        gone = {r: done for r, done in seen.items() if done}
        if not gone:
            return
        self.collectives -= 1  # not entered: a script that catches this stays in step
        self._write()
        raise CollectiveOnSomeRanksError(
            f"{call}() would wait for rank(s) {sorted(gone)}, which went on past it ("
            + _each(gone)
            + f"), under strategy={self.strategy!r}: this rank calls one more collective of ours than "
            "they do. Either this call runs on some ranks only (inside `if run.is_global_zero:`), "
            "or an earlier one did, met another rank's next call of the same shape through the same "
            "lines (a loop run once more on this rank), and gave a wrong value on both. Call every "
            "collective of ours on every rank and use the result on one: `total = lite.all_reduce(x)` everywhere, then "
            "`if run.is_global_zero: print(total)`; a value rank 0 alone has needs no collective."
        )

    def collective(self) -> None:
        """This rank enters a collective of ours: a rank about to gather alone sees it here
        and knows this one will not come to its gather."""
        self.collectives += 1
        self._write()

    @contextlib.contextmanager
    def inside_join(self) -> Iterator[None]:
        """A ``lite.join`` block, however it ends. Inside it the join protocol keeps the ranks
        in step: no forward is noted there (:meth:`forward`), and its rounds count as
        collectives only while it is open (a rank evaluating alone outside it learns that the
        others are in one). Leaving it, every rank takes those rounds back (a serving rank's
        rounds are not the running rank's collectives) and starts a new epoch, whatever way
        it left (in step, by a refusal on some ranks, by an exception): only entries of the
        same epoch compare, so no rank reads another that is still inside the block."""
        collectives = self.collectives
        try:
            yield
        finally:
            self.epoch += 1
            self.collectives = collectives
            if not self.broken:
                self._write()

    def realign(self) -> None:
        """Every rank refused the same backward together (a step skipped on some ranks, under
        ddp or DeepSpeed: ``skipped_step.py``): their counts of forwards differ by the skip, so
        all counts start again here, in a new epoch that only entries of the same epoch are
        compared in."""
        self.epoch += 1
        self.step = self.collectives = 0
        self.forwards = self.backwards = self.forwards_at_backward = 0
        self.checked = ((0, ""), (0, ""))
        self._write()

    def cannot_go_on(self, reason: str) -> None:
        """This rank left the others inside collectives it cannot finish (``reason`` says
        which): every later step of it raises, and so does the end of its block, so that the
        run ends (the supervisor stops the others) even where the script catches the error."""
        self.broken = self.broken or reason

    def leave_block(self) -> None:
        """This rank reached the end of its launch block: no later step of another rank
        will be met by this one."""
        self.ended = True
        self._write()
        self._end_reads = (time.monotonic(), 0.0)

    def waiting_at_end(self) -> None:
        """Called while this rank, at the end of its block, waits for the others: raises
        :class:`ForwardOnSomeRanksError` where one of them went on to a training forward or
        a backward this rank never ran (an early stop decided on some ranks only, or ranks
        with different numbers of batches outside ``lite.join``). That rank waits in the
        step's collectives for this one, which will never take it: alone, both would wait
        until the hang watchdog (or ``launch(timeout=)``) ended the run, naming no cause. A
        rank that gathers alone, or enters a collective of ours
        alone, is refused by its own ledger, so only these are looked for here. Reads the
        others' lines once the wait has lasted 0.2 s, then once a second: ranks that arrive
        together never read."""
        started, last = self._end_reads
        now = time.monotonic()
        if now - started < 0.2 or now - last < 1.0:
            return
        self._end_reads = (started, now)
        others = [r for r in range(self.world_size) if r != self.rank]
        went_on = {
            r: past
            for r, entry in zip(others, self._entries(others))
            if not entry.ended and entry.epoch == self.epoch and (past := self._past(entry))
        }
        if went_on:
            raise ForwardOnSomeRanksError(
                f"This rank reached the end of its launch block, but rank(s) {sorted(went_on)} went on ("
                + _each(went_on)
                + f"), under strategy={self.strategy!r}. They wait in that step's collectives for this "
                "rank, which will never take it. A loop ran more steps on some ranks: either the "
                "ranks had different numbers of batches (run the loop inside `with lite.join(model):`, "
                "or give every rank as many: `lite.setup_dataloader`), or a stop was decided on some "
                "ranks only (`if run.is_global_zero and val_loss > best: break`). Decide it on every "
                'rank together: `stop = lite.all_reduce(float(should_stop), op="max") > 0`, then '
                "`break` everywhere."
            )

    def _past(self, entry: _Entry) -> str:
        """What another rank's line shows it ran beyond this rank's end ("": nothing)."""
        if entry.forwards > self.forwards:
            return _forward_past(entry.forwards, self.forwards)
        if entry.backwards > self.backwards:
            return f"went on to backward {entry.backwards} (this rank has run {self.backwards})"
        return ""

    def _together(self, what: str) -> tuple[list[int] | None, dict[int, str]]:
        """Note ``what`` as this rank's next step and wait for every rank to reach that step.
        Returns ``(None, seen)`` when all ranks do ``what`` there, else ``(callers, seen)``,
        with this rank's step taken back (nothing was gathered: it is still in step with the
        others and may go on, e.g. to the forward they went on to, if it catches the error)."""
        before = self.step, self.checked
        self.step += 1
        self.checked = ((self.step, what), self.checked[0])
        self._write()
        seen = self._wait_for_step()
        callers = sorted(r for r, done in seen.items() if done == what)
        if len(callers) == self.world_size:
            return None, seen
        self.step, self.checked = before
        self._write()
        return callers, seen

    def close(self) -> None:
        """Let go of the store when the run ends (the strategy's ``stop``).

        Held past the block, the store hosted by rank 0 outlived its run, with its server
        thread: a later launch block in the process (a notebook, a script's second block)
        forks its workers from that process, and the forked workers hung.
        """
        self.store = None

    def _write(self) -> None:
        if self.broken:
            raise RuntimeError(f"This rank was refused earlier, and the run cannot go on: {self.broken}")
        if self.store is None:
            raise RuntimeError(
                f"The {self.strategy} run this model was set up in has ended: its parameters can no "
                "longer be gathered. Use the model inside its `with lite.launch(...)` block."
            )
        (latest, latest_name), (earlier, earlier_name) = self.checked
        entry = (
            f"{self.epoch}:{self.step}:{self.collectives}:{int(self.ended)}:{self.forwards}:"
            f"{self.backwards}:{self.forwards_at_backward}:{latest}:{earlier}:{latest_name}{_NAMES}{earlier_name}"
        )
        self.store.set(self._key(self.rank), entry)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _wait_for_step(self) -> dict[int, str]:
        """What each rank does at this rank's current step: a method's name, "forward", or
        that it cannot get there (it waits in a collective of ours, or its block ended)."""

        def reached(entry: _Entry) -> str | None:
            same = entry.epoch == self.epoch  # counts of another epoch do not compare
            if same and entry.step >= self.step:  # it reached this step: what it did there
                return entry.at(self.step)
            if entry.ended:
                return _ENDED
            if same and entry.collectives > self.collectives:  # where this rank has not been
                return _IN_COLLECTIVE
            return None

        what = self.checked[0][1]
        seen = self._poll(reached, what, "to reach it")
        seen[self.rank] = what
        return seen

    def _poll(
        self,
        settle: Callable[[_Entry], str | None],
        who: str,
        until: str,
        first_pause: float = 0.0005,
        last_pause: float = 0.02,
    ) -> dict[int, str]:
        """Read the other ranks' lines until ``settle`` says, for each, what it does (None:
        it cannot tell yet); ``who`` waits ``until`` (for the timeout's message). The pauses
        between reads start at ``first_pause`` and double up to ``last_pause``."""
        seen: dict[int, str] = {}
        pending = [r for r in range(self.world_size) if r != self.rank]
        pause = first_pause
        deadline = time.monotonic() + self.timeout
        while pending:
            waiting = []
            for r, entry in zip(pending, self._entries(pending)):
                done = settle(entry)
                if done is None:
                    waiting.append(r)
                else:
                    seen[r] = done
            pending = waiting
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{who} waited {self.timeout:.0f} s (launch(timeout=)) for rank(s) {pending} "
                    f"{until} under strategy={self.strategy!r}; they never ran the model's forward "
                    "or method again (a raw torch.distributed call, or work that never ended)."
                )
            if pending:
                time.sleep(pause)
                pause = min(last_pause, pause * 2)
        return seen

    def _entries(self, ranks: list[int]) -> list[_Entry]:
        keys = [self._key(r) for r in ranks]
        # multi_get would wait, bounded by the store's timeout, for a key not yet written: asked
        # until every rank's line was seen once (a line, once written, stays)
        if not self._all_written:
            if not self.store.check(keys):
                return [_Entry() for _ in keys]
            self._all_written = len(keys) == self.world_size - 1
        return [_Entry.parse(value) for value in self.store.multi_get(keys)]


class Nesting:
    """How deep one set-up model is in its own forwards and methods; each outermost forward is
    noted in ``ledger`` (None: not noted, e.g. an FSDP unit inside the model, or one rank).

    ``enter`` and ``leave`` are its forward pre-hook (prepended: before the strategy's gather)
    and forward hook (``always_call``); a method's call is counted by :meth:`method`. Inside
    ``lite.join`` (``user_module`` in a join block) an evaluation forward is not checked: the
    join protocol announces every forward and the ranks out of data replay it.
    """

    def __init__(self, ledger: GatherLedger | None, user_module: torch.nn.Module | None = None) -> None:
        self.ledger = ledger
        self.user_module = user_module
        self.depth = 0

    def enter(self, module: torch.nn.Module, *_: Any) -> None:
        self.depth += 1  # first: a refusal below still leaves through ``leave``
        if self.depth == 1 and self.ledger is not None:
            evaluating = not (torch.is_grad_enabled() and module.training)
            joined = in_join(self.user_module if self.user_module is not None else module)
            self.ledger.forward(evaluating=evaluating, joined=joined)

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


@contextlib.contextmanager
def gathering_together(nesting: Nesting | None, user_module: torch.nn.Module, name: str) -> Iterator[None]:
    """A call that gathers the sharded parameters outside a forward (``state_dict()`` and
    ``load_state_dict()`` under ZeRO-3, ``save_pretrained``): every rank makes it together, or
    it is refused on the ranks that make it before anything is gathered. Inside ``lite.join``
    it always is (the ranks out of data replay forwards only: join/members.py); elsewhere when
    the ledger finds a rank doing something else (``if rank == 0: torch.save(model.state_dict(),
    ...)``). Inside a forward or a method already checked it runs as it is.

    Args:
        nesting: The model's forwards and methods (None: one rank, nothing to check).
        user_module: The user's module (asked whether it is joined).
        name: What the errors call it (``"GPT.state_dict"``).
    """
    if in_join(user_module):
        refuse_gather_in_join(name, "Call it on every rank after the `with lite.join(...)` block.")
    with every_rank_calls(nesting, name):
        yield


@contextlib.contextmanager
def every_rank_calls(nesting: Nesting | None, name: str) -> Iterator[None]:
    """An outermost call of ``name`` (``"GPT.generate"``) that gathers: the ledger returns
    when every rank calls it too, or raises :class:`MethodCalledOnSomeRanksError`; the call
    is counted as a method of ``nesting`` (a forward inside it is no gathering step of its
    own). Inside a forward or a method already checked, or on one rank (``nesting`` None),
    it runs as it is."""
    if nesting is None or nesting.depth:
        yield
        return
    if nesting.ledger is not None:
        nesting.ledger.method(name)  # every rank gathers with us, or this raises
    with nesting.method():
        yield


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One rank's line in the ledger (see :meth:`GatherLedger._write`)."""

    epoch: int = 0
    step: int = 0
    collectives: int = 0
    ended: bool = False
    forwards: int = 0
    backwards: int = 0
    forwards_at_backward: int = 0
    checked: tuple[tuple[int, str], tuple[int, str]] = ((0, ""), (0, ""))

    @classmethod
    def parse(cls, value: bytes) -> _Entry:
        if not value:
            return cls()
        epoch, step, collectives, ended, forwards, backwards, at_backward, latest, earlier, names = (
            value.decode().split(":", 9)
        )
        latest_name, earlier_name = names.split(_NAMES)
        return cls(
            int(epoch),
            int(step),
            int(collectives),
            ended == "1",
            int(forwards),
            int(backwards),
            int(at_backward),
            ((int(latest), latest_name), (int(earlier), earlier_name)),
        )

    def at(self, step: int) -> str:
        """What this rank did at ``step`` (not after its own current step): the checked call
        it made there, or a training forward."""
        for number, name in self.checked:
            if number == step:
                return name
            if number < step:
                break
        return _FORWARD


def _call(name: str) -> str:
    """A method's name as called (``GPT.generate()``); a read (``float() of ...``) as it is."""
    return name if name.endswith(")") else f"{name}()"


_WORDS = {
    _FORWARD: "went on to the model's forward",
    EVALUATION: "ran an evaluation forward instead",
    _ENDED: "reached the end of its launch block",
    _IN_COLLECTIVE: "waits in a collective (lite.barrier(), lite.all_reduce(), ...) this rank did not call",
    _OPTIMIZER_STEP: "went on to optimizer.step(), a collective here",
}


def _words(done: str) -> str:
    """What a rank that did ``done`` (a method's name, or one of the marks above) did, in words."""
    return _WORDS.get(done, f"called {_call(done)} instead")


def _each(done: dict[int, str]) -> str:
    """What each rank did (``{rank: "went on to ..."}``), for a refusal: "rank 1 ...; rank 2 ..."."""
    return "; ".join(f"rank {r} {text}" for r, text in sorted(done.items()))


def _forward_past(theirs: int, mine: int) -> str:
    """A rank that went on to training forward ``theirs``, where this rank has run ``mine``."""
    return f"went on to training forward {theirs} (this rank has run {mine})"


def _others(seen: dict[int, str], what: str) -> str:
    """What the ranks that do not do ``what`` do instead, for a refusal."""
    return _each({r: _words(done) for r, done in seen.items() if done != what})
