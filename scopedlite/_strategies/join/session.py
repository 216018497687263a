"""``lite.join`` over a process group (DDP, FSDP2, DeepSpeed ZeRO 1-3): the session loop.

A rank that has run out of data cannot simply wait: under sharding it owns a slice of every
parameter, and under DDP its gradients are all-reduced. It keeps taking part in every
collective of the ranks still running by *replaying*: each forward on a cached input (its
own last batch; a rank that never had one is sent an example), each backward with zero
output gradients, each optimizer step with the reduced gradient. Its contribution to every
reduction is exactly zero, and it ends with the same model as the others.

The roles, as in torch's ``join.py``:

- :class:`JoinSession` (this module): the loop. A running rank announces each forward,
  backward, collective step and lite collective in a *round*; a rank that has left the block
  (or waits at a collective the others have not reached yet) serves the rounds until every
  rank has left.
- :class:`JoinHook`: one small class per backend (``ddp/join.py``, ``fsdp/join.py``,
  ``deepspeed/join.py``): its hooks, and how it replays.
- :class:`~message.Step` / :class:`~message.Round`: the message each rank sends at
  the start of a round (an all-gather, on a CPU group under NCCL) and the verdict every rank
  reads from all of them alike.
- :class:`~events.EventRecorder`: local actions (``optimizer.step``, ``zero_grad``,
  ``scheduler.step``) carried on the next message and applied in order by the ranks serving.
- :class:`~collectives.JoinCollectives`: our collectives' payloads, with neutral values from
  the ranks serving.

**Free when even.** While every rank still has data there is nothing to replay. When a pass
over a loader from ``setup_dataloader`` begins, the ranks agree on each one's number of
batches (one round); if they are known, no round is opened until the shortest rank takes
its last batch (never, when all are equal), or a rank leaves its pass early (a ``break``: see
:meth:`PassCursor.left_early`). Loaders of unknown length, loops over anything else,
and what comes after the first rank ran out use the rounds.

**Lean while every rank runs.** A rank runs out of data between steps, when its loop asks for
the next batch. So when a round finds every rank at the same step, none serves the next one,
and from the third training forward of a model in the block (without buffers to broadcast)
its rounds need not be waited for where they are opened:

- where the forward gathers nothing (DDP, ZeRO-1/2) a training step has one round, the
  backward's, posted: the forward has none, the backward's names it, and a rank that serves
  and reads it runs that forward first;
- where the forward gathers parameters (FSDP, ZeRO-3, model_parallel) the forward's round is
  posted before its gathers and read before the backward, whose round is awaited: a rank
  whose forward raised midway could not answer the others' backward;
- DeepSpeed's collective step is posted as a backward is; lite.clip_gradients waits for its
  round.

A posted round is read at the next round, so the ranks' skew is waited out behind a step's
compute. Posted rounds are still sent because a rank that does something else instead (skips
a backward or a step, evaluates alone, leaves by an exception) must learn that the others are
in their collectives: it reads their round in its own next one and runs that forward, that
backward with zero gradients, or that step so that they get out
(:meth:`JoinSession._answer_posted`), and then refuses, or aborts, as they do at their next
round. The first round that finds a rank left, waiting or serving makes every rank
wait for its rounds again (they all read the same rounds).

**Replicas.** Under ``model_parallel`` the tensor-parallel ranks of a data-parallel replica
read the same batches: they run, wait and leave together (each round checks it), replay
together (their tensor-parallel collectives pair among themselves), and the running count
the gradient divisors use is one of replicas. Everywhere else a replica is one rank.

**Collectives matched by where they are called.** A lite collective carries its call site.
A rank that finished its pass over the loader and reaches a collective the others have not
reached *waits* there: it serves their rounds until they reach the same line (a collective
after the loop, inside the block), and is never matched with a different call. What cannot
be replayed is refused on every rank at once, before any value is computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from scopedlite._comm.debug import call_site, site_id
from scopedlite._comm.distributed import broadcast_any, gather_into_later
from scopedlite._comm.replicas import reduce_rows
from scopedlite._comm.wire import wire_dtype
from scopedlite._core.structures import map_tensors
from scopedlite._private.torch_internals import overwrite_buffers
from scopedlite._strategies.join.collectives import (
    PEER_LEFT,
    JoinCollectives,
    PeerLeftJoinError,
)
from scopedlite._strategies.join.events import EventRecorder
from scopedlite._strategies.join.guards import (
    refuse_distributed_norms,
    refuse_dtensor_collectives,
    refuse_raw_collectives,
)
from scopedlite._strategies.join.members import join_block
from scopedlite._strategies.join.message import (
    LENGTH,
    MAX_EVENTS,
    Action,
    Header,
    Kind,
    Round,
    Step,
)

if TYPE_CHECKING:
    from scopedlite._strategies.base import Strategy
    from scopedlite._strategies.join.hook import JoinHook

__all__ = ["PassCursor", "JoinSession"]

_MAX_OUTPUTS = 48  # output tensors a mask can describe exactly in a float64
_KEPT_FORWARDS = 8  # a serving rank keeps the replayed outputs of this many recent forwards


class _Announce(torch.autograd.Function):
    """Identity on a model's outputs; its backward announces the backward to serving ranks."""

    @staticmethod
    def forward(ctx: Any, session: JoinSession, index: int, seq: int, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.session, ctx.index, ctx.seq = session, index, seq
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        mask = sum(1 << i for i, g in enumerate(grads) if g is not None)
        scale = ctx.session.before_backward(ctx.index, ctx.seq, mask)
        if scale != 1.0:
            grads = tuple(g * scale if g is not None else None for g in grads)
        return (None, None, None, *grads)


class PassCursor:
    """One pass over a set-up loader inside the block: it starts the rounds when the shortest
    rank is about to take its last batch, and counts the pass as ended on this rank."""

    def __init__(self, session: JoinSession, switch_at: int | None) -> None:
        self.session = session
        self.switch_at = switch_at  # the batches every rank takes before the rounds start
        self.position = 0

    def advance(self) -> None:
        """The loop asks for the next batch."""
        self.position += 1
        if self.position == self.switch_at:
            self.session.start_rounds()

    def end(self) -> None:
        self.session.ended += 1

    def left_early(self) -> None:
        """The loop left the pass before its end (a ``break``, ``islice``, a peek): the pass
        is over on this rank. Where the ranks run free the others cannot know it, so the
        rounds start from here: this rank's next step, or its end of the block, waits for
        them in a round (where all left at the same batch, they meet there; else the hang
        watchdog names where each waits) instead of pairing a collective of its own (the
        final broadcast) with one of theirs (a gradient all-reduce)."""
        if self.session.closed:  # the iterator was collected after the block
            return
        self.end()
        self.session.rounds_from_next_step()


class JoinSession:
    """The join session over a process group (see the module docstring)."""

    def __init__(
        self,
        strategy: Strategy,
        hook: JoinHook,
        models: tuple[torch.nn.Module, ...],
        optimizers: tuple[torch.optim.Optimizer, ...],
        group: Any,
        replicas: tuple[int, ...] | None = None,
        ledger: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        self.strategy = strategy
        self.ledger = ledger  # the gather ledger's scope around the block (lockstep.py), if kept
        self.hook = hook
        self.models = models
        self.optimizers = optimizers
        self.group = group  # where the step messages travel: a CPU (gloo) group
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.device = strategy.comm_device
        self.events = EventRecorder(
            optimizers,
            tuple(m for _, m in hook.zero_grad_owners()),
            hook.records_steps,
            lambda: strategy.set_up.schedulers_of(optimizers),
        )
        self.collectives = JoinCollectives(self._announce_collective, self.rank, self.world_size, self.device)
        self._rounds = True  # the protocol's rounds run (False: every rank has data: free)
        self._rounds_due = False  # they start at this rank's next step (a pass left early)
        self.serving = False  # this rank replays the others' steps (left the block, or waits)
        # The data-parallel replica of each rank: under model_parallel the tensor-parallel ranks
        # of a replica read the same batches, so they run, wait and leave together, and the
        # gradients are averaged over replicas; elsewhere each rank is one.
        self.replicas = replicas if replicas is not None else tuple(range(self.world_size))
        self.count = len(set(self.replicas))  # running replicas
        self._refused = False  # a round's verdict raised on every rank at once
        self.ended = 0  # passes of set-up loaders this rank finished inside the block
        self.forwards = 0  # forwards so far: the same count on every rank
        self.inputs: dict[int, tuple[Any, Any]] = {}  # model index -> last (args, kwargs)
        self.outputs: dict[int, list[torch.Tensor]] = {}  # forward number -> replayed outputs
        self.own_unsynced = [False] * len(models)  # this rank's last own backward skipped the sync
        self._forward_synced: dict[int, bool] = {}  # model -> its last forward prepared a gradient sync
        self._recording_started = False
        self.lean = True  # the last round found every rank at the same step: see the module docstring
        self._posted: tuple[Callable[[], None], torch.Tensor] | None = None  # a round opened without waiting, unread
        # model -> training forwards every rank ran in this block, announced together
        self._forwards_together: dict[int, int] = {}
        # model -> (forward number, outputs) of its last training forward while its backward is to come
        self._unanswered: dict[int, tuple[int, list[torch.Tensor]]] = {}
        # model -> number of its forward under way on this rank (until its outputs exist), and
        # the input of its last forward that returned (to answer with, if this one raises)
        self._under_way: dict[int, int] = {}
        # torch's and DeepSpeed's collectives in the block (guards.py), for a forward that raises:
        # the count when each forward under way started (and whether with gradients), and how many
        # the last forward of each model that returned issued, with and without gradients
        self._collectives = 0
        self._started_at: dict[int, tuple[int, bool]] = {}
        self._issued: dict[tuple[int, bool], int] = {}
        self._returned: dict[int, tuple[Any, Any]] = {}
        self._stack = contextlib.ExitStack()
        self.closed = False

    # -- the block ---------------------------------------------------------------------------------
    def __enter__(self) -> JoinSession:  # noqa: PYI034 - typing.Self needs Python 3.11
        try:
            if self.ledger is not None:  # entered first, left last, on every way out
                self._stack.enter_context(self.ledger)
            self._stack.enter_context(join_block(self.strategy.unwrap(m) for m in self.models))  # asked by user methods
            self._stack.enter_context(self.hook.install(self))
            self._stack.enter_context(refuse_raw_collectives(self._count_collective))
            self._stack.enter_context(refuse_distributed_norms())
            self._stack.enter_context(refuse_dtensor_collectives(self.replicas))
            self._stack.callback(self.events.close)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None:
                self._leave()
                self.strategy.join_left()  # every rank leaves here, in step with the others
            elif (
                self._rounds  # not a pass left early by this very exception: the others run free
                and isinstance(exc, Exception)
                and not isinstance(exc, PeerLeftJoinError)
                and not self._refused
            ):
                if self._abort_round():
                    self.strategy.join_left()  # every rank reads the ABORT in the same round
            elif self._refused or isinstance(exc, PeerLeftJoinError):
                # Every rank raised from the same round: they leave in step, and a script
                # that catches the error goes on with the checks of outside the block.
                self.strategy.join_left()
        finally:
            self._drop_posted()
            self._unanswered.clear()
            self._under_way.clear()
            self._started_at.clear()
            self._returned.clear()
            self.inputs.clear()
            self.outputs.clear()
            self._stack.close()
            self.closed = True

    def _leave(self) -> None:
        if not self.rounds:  # every rank had data up to here: all leave together
            self.hook.finish(self.world_size - 1)
            return
        self.serving = True
        self.events.recording = False
        first = True
        while True:
            events = self.events.take(MAX_EVENTS) if first else ()
            if first and self.events.pending:
                raise RuntimeError(
                    f"Inside lite.join this rank called {len(events) + len(self.events.pending)} "
                    f"optimizer/scheduler methods after its last forward; at most {MAX_EVENTS} can "
                    "be reported to the other ranks. Move them after the `with lite.join(...)` block."
                )
            said = Step(
                Kind.LEFT,
                ended=self.ended,
                reports=first,
                needs=self._needs(),
                events=events,
                scheduler_steps=self.events.scheduler_steps(),
            )
            round_ = self._round(said)
            if round_.over:
                self._check_schedulers(round_)
                break
            self._replay(round_)
            first = False
        self.hook.finish(round_.authoritative())

    def _abort_round(self) -> bool:
        """Tell the other ranks that this one leaves the block by an exception.

        They wait in a round for steps this rank will never announce; were it to catch the
        exception and go on, its next collective would be taken for one of the protocol's.
        One ABORT message makes every rank that reads it raise :class:`PeerLeftJoinError`,
        all of them in step. Returns whether the ranks are in step (False: the group broke).
        """
        if self._forward_broke() is not None:
            return False
        try:
            self._settle()
        except Exception:  # noqa: BLE001 - refused or aborted on every rank in that round: no ABORT needed
            return True
        try:
            round_ = self._exchange(Step(Kind.ABORT))
        except Exception:  # noqa: BLE001 - the group is broken already: its own error says so
            return False
        # While every rank runs, the others may be in the gradient collectives of a forward this
        # rank ran too (they read this ABORT at their next round): it takes part in them.
        self._answer_posted(round_)
        return True

    def _count_collective(self) -> None:
        self._collectives += 1

    def _forward_broke(self) -> str | None:
        """Why this rank cannot go on (None: it can), where forwards gather parameters
        (FSDP, ZeRO-3, model_parallel) and a forward of this rank raised between two of its
        gathers: it issued fewer of torch's and DeepSpeed's collectives than the last forward
        of that model that returned (none returned yet: it cannot tell, so it counts as
        such). The other ranks then wait in the next gather, where no round reaches them (a
        message of ours would be taken for one of their gathers: gloo aborted the process,
        NCCL would hang), and this rank has no outputs to answer a backward with. So from
        here every step of this rank raises, and so does the end of its block
        (:meth:`ProcessGroupStrategy.cannot_go_on`): the run ends with the forward's own
        error unless the script catches it, and with this one where it does. A forward that
        raised after its last gather sends the abort round as any other error does: the
        others meet it in their next round."""
        if not self.hook.forward_communicates:
            return None
        for index, (started, grad) in self._started_at.items():  # the forwards under way: they raised
            if self._collectives - started < self._issued.get((index, grad), 1 << 62):
                break  # it issued fewer collectives than the last that returned (or none returned)
        else:
            return None  # each raised after its last gather: the abort round reaches the others
        reason = (
            f"inside lite.join a forward of model {index} raised on this rank between two of its "
            "parameter gathers, and the other ranks wait in the next one, which this rank cannot "
            "join. Let that error end the run, or have the forward raise on every rank together "
            '(check the batch before it: `bad = lite.all_reduce(float(not ok), op="max") > 0`)'
        )
        self.strategy.cannot_go_on(reason)
        return reason

    # -- rounds --------------------------------------------------------------------------------------
    def _open(self, said: Step) -> tuple[Callable[[], None], torch.Tensor]:
        """Start the all-gather of every rank's step: (the function that waits for it, the rows)."""
        self._settle()  # rounds are read in order
        self.strategy.note_collective()  # a rank evaluating alone under FSDP learns we are here
        row = torch.tensor(said.encode(), dtype=torch.float64)
        rows = torch.empty(self.world_size * LENGTH, dtype=torch.float64)
        return gather_into_later(rows, row, group=self.group), rows

    def _exchange(self, said: Step) -> Round:
        wait, rows = self._open(said)
        wait()
        return Round(rows.view(self.world_size, LENGTH).tolist())

    def _post_or_announce(self, said: Step, may_post: bool) -> Round | None:
        """A running rank's round: where ``may_post`` (and this rank's pending events fit in
        one message), opened without waiting for it, marked ``posted`` and read by
        :meth:`_settle` at the next round (None); else announced and awaited (its Round)."""
        if not may_post or len(self.events.pending) > MAX_EVENTS:
            return self._announce(said)
        posted = dataclasses.replace(said, posted=True)
        self._posted = self._open(posted.with_events(self.events.take(MAX_EVENTS), True, self.ended, self._needs()))
        return None

    def _settle(self) -> None:
        """Wait for the round this rank opened without waiting (a forward's, a backward's or
        a step's), and read it as any round.

        Only a running rank opens one, so this rank is one of the runners there (a rank past
        the others is refused by the round itself).
        """
        if self._posted is None:
            return
        wait, rows = self._posted
        self._posted = None
        wait()
        self._read(Round(rows.view(self.world_size, LENGTH).tolist()))

    def _drop_posted(self) -> None:
        """The block ends by an exception with a round still open: wait for it, unread."""
        if self._posted is not None:
            wait, _ = self._posted
            self._posted = None
            with contextlib.suppress(Exception):  # the block's own exception is the one to report
                wait()

    def _round(self, said: Step) -> Round:
        """One round: every rank's step, checked; on a serving rank, the events of the
        ranks that ran since the last round applied."""
        return self._read(self._exchange(said))

    def _read(self, round_: Round) -> Round:
        if round_.aborted:
            raise PeerLeftJoinError(PEER_LEFT)
        problem = (
            (round_.disagreement() if not round_.over else None)
            or round_.replica_problem(self.replicas)
            or round_.events_problem()
        )
        if problem is not None:
            self._answer_posted(round_)  # whoever posted this round is in its collectives
        self._refuse(problem)
        for event in round_.events_to_apply(self.rank):
            self.events.apply(event, self.rank)
        if round_.over:
            return round_
        self._set_count(len({self.replicas[r] for r in round_.runners}))
        self.lean = len(round_.runners) == self.world_size
        if self.lean and round_.step.kind == Kind.FORWARD and round_.step.grad:
            index = round_.step.model
            self._forwards_together[index] = self._forwards_together.get(index, 0) + 1
        if not self._recording_started and round_.step.kind != Kind.PASS:
            self._recording_started = True  # a rank may serve from here: record (once per block)
            self.events.start()
        return round_

    def _answer_posted(self, round_: Round) -> None:
        """A rank that posted its round (a forward that gathers parameters, a backward, or
        DeepSpeed's collective step: see "Lean while every rank runs") is in its collectives
        already. This rank, which will not run that step (it refuses the round, or leaves by
        an exception), runs it as a serving rank would - the forward on its cached input, the
        backward with zero gradients, the step with the reduced ones - so that the other gets
        out and reads the same verdict at its next round."""
        mine = round_.steps[self.rank]
        answered = set()
        for r in round_.runners:
            said = round_.steps[r]
            if r == self.rank or not said.posted or said.key() == mine.key() or said.key() in answered:
                continue
            seq, outputs = self._unanswered.get(said.model, (None, []))
            if said.kind == Kind.FORWARD:  # it gathers parameters: this rank gathers with it
                with self._answering():
                    self._replay_forward(said.model, said.seq, said.grad, said.sync)
                self.outputs.pop(said.seq, None)
                answered.add(said.key())
                continue
            keep_own = said.sync and self.own_unsynced[said.model]
            if said.kind == Kind.BACKWARD and seq == said.seq:
                del self._unanswered[said.model]
            elif (
                said.sync and not mine.sync and mine.same_forward(said) and not self.hook.unsynced_backward_communicates
            ):
                # this rank ran that backward inside no_backward_sync, the other synchronises
                # it: take part with zero gradients, keeping this rank's own for its window
                outputs = self._forward_again(said.model, said.sync)
                if outputs is None:
                    continue
                keep_own = False
            elif said.kind == Kind.BACKWARD and (
                self._under_way.get(said.model) == said.seq or said.seq > self.forwards
            ):
                # this rank's forward raised before its outputs existed, or it did not run it
                outputs = self._forward_again(said.model, said.sync)
                if outputs is None:
                    continue
            elif said.kind != Kind.STEP:
                continue
            answered.add(said.key())
            with self._answering():
                if said.kind == Kind.STEP:
                    self.hook.step(said.model)
                else:
                    with torch.enable_grad():  # it may refuse inside torch.no_grad()
                        self.hook.backward(said.model, outputs, said.sync, keep_own)

    @contextlib.contextmanager
    def _answering(self) -> Any:
        """This rank runs a step for the others, as a serving rank replays one: its own hooks
        stay quiet, and a forward's outputs are kept in ``self.outputs``."""
        self.serving = True
        try:
            yield
        finally:
            self.serving = False

    def _forward_again(self, index: int, sync: bool) -> list[torch.Tensor] | None:
        """This rank's forward of model ``index`` raised before its outputs existed, or this
        rank did something else instead (that forward had no round: see :meth:`_lean_forward`),
        while the others went on to its backward: run it on the input of this rank's last
        forward that returned, to have outputs to answer that backward with. Only where a
        forward gathers nothing (DDP, ZeRO-1/2: the others did not wait for this rank in it);
        None where there is no such input."""
        if index not in self._returned:
            return None
        args, kwargs = self._returned[index]
        with self._answering(), _buffers_kept(self.hook.module(index)), torch.enable_grad():
            self.hook.forward(index, args, kwargs, sync)
        return self.outputs.pop(self.forwards, None)

    def _refuse(self, problem: str | None) -> None:
        """Raise the verdict every rank reads from the same round, on every rank at once:
        no rank waits for another's abort round."""
        if problem is not None:
            self._refused = True
            raise RuntimeError(problem)

    def _announce(self, said: Step) -> Round:
        """Run a round as a running rank; wait (serving) while it is ahead of the others."""
        while len(self.events.pending) > MAX_EVENTS:
            self._round(Step(Kind.EVENTS, ended=self.ended, reports=True, events=self.events.take(MAX_EVENTS)))
        reports = True
        try:
            while True:
                events = self.events.take(MAX_EVENTS) if reports else ()
                # needs: a rank that waits here with no batch yet replays from an example
                round_ = self._round(said.with_events(events, reports, self.ended, self._needs()))
                if self.rank in round_.runners:
                    return round_
                self.serving = True  # ahead of the others: serve them until they get here
                self.events.recording = False
                reports = False
                self._replay(round_)
        finally:
            if not reports:
                self.serving = False
                self.events.recording = self._recording_started

    def _set_count(self, count: int) -> None:
        if count != self.count:
            self.count = count
            self.hook.active_count(count)

    def _needs(self) -> int:
        return sum(1 << i for i in range(len(self.models)) if i not in self.inputs)

    # -- free when even ----------------------------------------------------------------------------
    @property
    def rounds(self) -> bool:
        """Whether the protocol's rounds run (False: every rank has data and runs free)."""
        if self._rounds_due:
            self._rounds_due = False
            self.start_rounds()
        return self._rounds

    def rounds_from_next_step(self) -> None:
        """This rank left a pass early: the rounds start at its next step, or at its end of
        the block, but not for an exception that left the pass (the others, running free,
        would never answer its abort round; the launch stops them)."""
        self._rounds_due = not self._rounds

    def start_rounds(self) -> None:
        """Every rank is at the same point and some rank is about to run out: rounds from here."""
        if not self._rounds:
            self._rounds = True
            self._recording_started = True
            self.events.start()

    def shares_every_step(self) -> bool:
        """Whether code that shares per-rank counts at intervals (``lite.throughput``) must
        share them at every step from here, because a rank may run out of data before the
        next interval and what it counted would be left out: the rounds run (from the
        shortest rank's last batch on). False while every rank has data for more; the same
        answer on every running rank."""
        return self.rounds

    def loader_pass(self, length: int | None) -> PassCursor:
        """A pass over a set-up loader begins with ``length`` batches on this rank (None:
        unknown): the ranks agree on their lengths, and run free while all have data."""
        said = Step(Kind.PASS, site=site_id(call_site()), length=-1 if length is None else length)
        round_ = self._announce(said) if self.rounds else self._free_round(said)
        lengths = [round_.steps[r].length for r in round_.runners]
        shortest, longest = min(lengths), max(lengths)
        # The shortest rank's last batch runs with rounds: a script often does something else
        # there on that rank only (ends an accumulation window, logs the epoch's end keyed on
        # len(loader)), which a round sees and refuses, where without one the ranks would pair
        # different collectives.
        free = None if shortest == longest else shortest - 1
        if len(round_.runners) < self.world_size or shortest <= 0 or free == 0:
            self.start_rounds()
            return PassCursor(self, None)  # rounds from here: every step is shared anyway
        if self.rounds:
            self._rounds = False
            self.events.pause()
            self.outputs.clear()
        return PassCursor(self, free)

    def _free_round(self, said: Step) -> Round:
        round_ = self._exchange(said.with_events((), True, self.ended))
        self._refuse(round_.disagreement() or round_.replica_problem(self.replicas))
        return round_

    # -- running ranks: hooks -----------------------------------------------------------------------
    def before_forward(self, index: int, args: Any, kwargs: Any) -> None:
        """Announce a forward of model ``index`` and remember its input for a later replay."""
        if self.serving:
            return
        broke = self._forward_broke()
        if broke is not None:  # the last forward raised midway, and the script went on
            raise RuntimeError(f"This rank cannot go on: {broke}.")
        self.inputs[index] = (args, kwargs)
        sync = self._forward_synced[index] = self.hook.sync_flag(index)
        buffers = self.hook.buffer_flag(index)
        source = self.world_size - 1
        lean = self._lean_forward(index, buffers)
        # DDP, ZeRO-1/2: no round at all, the backward's tells of it (see _lean_forward)
        no_round = lean and not self.hook.forward_communicates and self.hook.divide
        if self.rounds and not no_round:
            said = Step(
                Kind.FORWARD,
                model=index,
                grad=torch.is_grad_enabled(),
                sync=sync,
                buffers=buffers,
                seq=self.forwards + 1,
            )
            self._settle()  # the last round decides whether this one may be posted: asked again
            round_ = self._post_or_announce(said, lean and self._lean_forward(index, buffers))
            if round_ is not None:
                source = max(round_.runners)
                if any(o.needs >> index & 1 for o in round_.steps):
                    self._exchange_example(index, (args, kwargs), min(round_.runners))
        self.forwards += 1
        self._under_way[index] = self.forwards
        self._started_at[index] = (self._collectives, torch.is_grad_enabled())
        if buffers:
            self.hook.sync_buffers(index, source)

    def _lean_forward(self, index: int, buffers: bool) -> bool:
        """Whether this forward's round may be read after it: every rank ran the last step
        (lean), and the forward broadcasts nothing: no buffers, and not DDP's one-time bucket
        rebuild (a broadcast in the first training forward after the first backward: from
        the third training forward in the block on, it is behind). Every rank then also
        holds an input of this model (no example to send).

        Where the forward gathers nothing (DDP, ZeRO-1/2) it then has no round at all: its
        backward's round tells the others of it, and a serving rank runs the forward then
        (:meth:`_replay`) - but with ``divide_by_initial_world_size=False``, where the
        backward's divisor is the number of ranks running, which this round tells. Where it
        gathers parameters (FSDP, ZeRO-3, model_parallel) its round is posted before the
        gathers; a rank that refuses it, or left by an exception, runs that forward to answer
        it (:meth:`_answer_posted`), and the poster reads the verdict before its backward."""
        return (
            self.lean
            and not buffers
            and torch.is_grad_enabled()
            and self._forwards_together.get(index, 0) >= 2
            and index not in self._unanswered  # the last forward's backward ran (else: see _answer_posted)
        )

    def after_forward(self, index: int, output: Any) -> Any:
        """Wrap the outputs that need a gradient in the announcing identity."""
        if not self.serving:
            self._under_way.pop(index, None)
            started, grad = self._started_at.pop(index, (self._collectives, False))
            self._issued[index, grad] = self._collectives - started
        if not torch.is_grad_enabled():
            return output
        tensors: list[torch.Tensor] = []
        map_tensors(output, lambda t: tensors.append(t) if t.requires_grad else None)
        if not tensors:
            return output
        if len(tensors) > _MAX_OUTPUTS:
            raise ValueError(
                f"Inside lite.join a model may return at most {_MAX_OUTPUTS} tensors that need a "
                f"gradient; model {index} returned {len(tensors)}. Return fewer (stack them)."
            )
        wrapped = list(_Announce.apply(self, index, self.forwards, *tensors))  # in the output's order
        taken = iter(wrapped)
        result = map_tensors(output, lambda t: next(taken) if t.requires_grad else t)
        if not self.serving and self.rounds:
            self._unanswered[index] = (self.forwards, wrapped)
            self._returned[index] = self.inputs[index]
        if self.serving:
            # Kept until the backward of this forward is announced; a few forwards may come
            # before one backward, none is kept for ever.
            self.outputs[self.forwards] = wrapped
            for old in [k for k in self.outputs if k <= self.forwards - _KEPT_FORWARDS]:
                del self.outputs[old]
        return result

    def before_backward(self, index: int, seq: int, mask: int) -> float:
        """Announce the backward of forward number ``seq`` (of model ``index``); returns the
        factor for its output gradients."""
        if self.serving:
            return 1.0
        if seq != self.forwards:
            raise RuntimeError(
                f"Inside lite.join a backward went through the outputs of forward #{seq} of model "
                f"{index} after forward #{self.forwards} had run: a loss built from several forwards "
                "of a model (or a backward of an older forward) cannot be replayed by ranks that "
                "ran out of data, which run one backward per forward. Concatenate the inputs into "
                "one forward, or call lite.backward after each forward."
            )
        sync = self.hook.backward_syncs(index, self._forward_synced.get(index, True))
        self.own_unsynced[index] = not sync
        self._unanswered.pop(index, None)
        self._settle()
        if self.rounds:
            # Every rank ran this forward (lean): its round is read at the next one, and waits
            # for nothing here. It pairs with the next round of a rank that skips this
            # backward, which refuses there (answering this backward first). Where the forward
            # gathers parameters it is awaited: a rank whose forward raised midway could not
            # answer it (see _answer_posted).
            said = Step(
                Kind.BACKWARD,
                model=index,
                sync=sync,
                mask=mask,
                seq=seq,
                holding=sync and self.hook.holds_gradients(index),
            )
            self._post_or_announce(said, self.lean and not self.hook.forward_communicates)
        return self.hook.output_scale(self.count)

    def before_step(self, index: int) -> None:
        """Announce a collective optimizer step (DeepSpeed's ``engine.step``)."""
        if self.serving or not self.rounds:
            return
        optimizer = self.optimizers[index] if index < len(self.optimizers) else None
        lr = self.events.check_lr(optimizer) if optimizer is not None else 0.0
        self._settle()  # the last round decides whether this one may be posted
        self._post_or_announce(Step(Kind.STEP, model=index, lr=lr), self.lean)  # as a backward's

    def clip_gradients(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        clip_val: float | None,
        norm_type: float = 2.0,
    ) -> Any:
        """``lite.clip_gradients`` inside the block: serving ranks clip their shards too."""
        index = self.events.index_of(optimizer)
        model = next((m for m, known in enumerate(self.models) if known is module), None)
        if model is None:
            raise ValueError(
                "lite.clip_gradients inside lite.join takes a model of the block (one returned "
                "by lite.setup and joined: `with lite.join(model):`), got a "
                f"{type(module).__name__}."
            )
        if self.rounds:
            self._announce(
                Step(
                    Kind.CLIP,
                    model=model,
                    optimizer=index,
                    max_norm=None if max_norm is None else float(max_norm),
                    clip_val=None if clip_val is None else float(clip_val),
                    norm_type=float(norm_type),
                )
            )
        return self.hook.clip(model, optimizer, max_norm, clip_val, norm_type)

    # -- our collectives ---------------------------------------------------------------------------
    def in_step(self) -> bool:
        """Whether every rank has data and runs free: our collectives then go straight to the
        strategy, every rank in the same call (so ``lite.all_gather``'s shape check can run
        there as outside the block)."""
        return not self.rounds

    def _announce_collective(self, header: Header) -> Round:
        return self._announce(Step(Kind.COLLECTIVE, site=site_id(call_site()), header=header))

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if not self.rounds:
            return self.strategy.all_reduce(tensor, op)
        return self.collectives.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.rounds:
            return self.strategy.all_gather(tensor)
        return self.collectives.all_gather(tensor)

    def all_reduce_replicas(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Each running replica counted once (``_comm/replicas.py``)."""
        if not self.rounds:
            return self.strategy.all_reduce_replicas(tensor, op)
        if len(set(self.replicas)) == self.world_size:  # each rank a replica of its own
            return self.collectives.all_reduce(tensor, op)
        rows = self.all_gather_replicas(tensor.to(wire_dtype(tensor.dtype, op)))
        return reduce_rows(rows, op, tensor.dtype)

    def all_gather_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.rounds:
            return self.strategy.all_gather_replicas(tensor)
        if len(set(self.replicas)) == self.world_size:
            return self.collectives.all_gather(tensor)
        return self.collectives.all_gather_replicas(tensor, self.replicas)

    def broadcast(self, obj: Any, src: int) -> Any:
        if not self.rounds:
            return self.strategy.broadcast(obj, src)
        return self.collectives.broadcast(obj, src)

    def barrier(self) -> None:
        if not self.rounds:
            self.strategy.barrier()
        else:
            self.collectives.barrier()

    # -- serving ranks ----------------------------------------------------------------------------------
    def _exchange_example(self, index: int, example: tuple[Any, Any] | None, src: int) -> tuple[Any, Any]:
        """Send ranks without any batch an input to replay with (once per model and block)."""
        received = broadcast_any(example if self.rank == src else None, src, self.device)
        device = self.strategy.placement.device
        return map_tensors(received, lambda t: t.to(device))  # type: ignore[no-any-return]

    def _replay(self, round_: Round) -> None:
        """Take part in the step the running ranks announced in ``round_``."""
        step = round_.step
        if step.kind == Kind.FORWARD:
            if any(o.needs >> step.model & 1 for o in round_.steps):
                example = self._exchange_example(step.model, None, min(round_.runners))
                self.inputs.setdefault(step.model, example)
            if step.buffers:  # the running ranks' buffers, as DDP under torch's Join
                self.hook.sync_buffers(step.model, max(round_.runners))
            self._replay_forward(step.model, step.seq, step.grad, step.sync)
        elif step.kind == Kind.BACKWARD:
            outputs = self.outputs.pop(step.seq, None)
            if outputs is None and self._unanswered.get(step.model, (None,))[0] == step.seq:
                outputs = self._unanswered.pop(step.model)[1]  # its own last forward, left without a backward
            elif outputs is None and step.seq > self.forwards:  # the forward had no round (lean): run it now
                self._replay_forward(step.model, step.seq, True, step.sync)
                outputs = self.outputs.pop(step.seq, None)
            chosen = [t for i, t in enumerate(outputs or []) if step.mask >> i & 1]
            # its own micro-batches, or the window's average that the running ranks hold too
            holding = all(round_.steps[r].holding for r in round_.runners)
            keep_own = step.sync and (self.own_unsynced[step.model] or holding)
            if step.sync:
                self.own_unsynced[step.model] = False
            with torch.enable_grad():  # it may serve inside torch.no_grad() (a collective after its loop)
                self.hook.backward(step.model, chosen, step.sync, keep_own)
        elif step.kind == Kind.STEP:
            if step.model < len(self.optimizers):
                self.events.compare_lr(self.optimizers[step.model], step.lr, self.rank)
            self.hook.step(step.model)
        elif step.kind == Kind.CLIP:
            optimizer = self.optimizers[step.optimizer]
            self.hook.clip(step.model, optimizer, step.max_norm, step.clip_val, step.norm_type)
        elif step.kind == Kind.COLLECTIVE:
            self.collectives.serve(round_)
        # PASS, EVENTS: the round was all

    def _replay_forward(self, index: int, seq: int, grad: bool, sync: bool) -> None:
        """Run forward number ``seq`` of model ``index`` as the running ranks did, on this
        rank's cached input; its outputs wait in ``self.outputs`` for their backward."""
        args, kwargs = self.inputs[index]
        self.forwards = seq
        with _buffers_kept(self.hook.module(index)), torch.set_grad_enabled(grad):
            self.hook.forward(index, args, kwargs, sync)

    def _check_schedulers(self, round_: Round) -> None:
        """Every rank has left: its schedulers must have stepped as often as everyone's."""
        counts = {
            o.scheduler_steps + sum(e.action == Action.SCHEDULER_STEP for e in round_.events_to_apply(r))
            for r, o in enumerate(round_.steps)
        }
        if len(counts) > 1:
            raise RuntimeError(
                "Inside lite.join the ranks' LR schedulers stepped a different number of times "
                f"({sorted(counts)}). The usual cause is a scheduler stepped after the loop but "
                "inside the join block, on a rank that had no batch: call it after the "
                "`with lite.join(...)` block."
            )


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module) -> Any:
    """A replayed forward leaves the serving rank's buffers (BatchNorm statistics) as they were."""
    buffers = [b for b in module.buffers() if b is not None]
    saved = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        overwrite_buffers(buffers, saved)
