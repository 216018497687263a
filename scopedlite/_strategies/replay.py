"""``lite.join`` over a process group (DDP, FSDP2, DeepSpeed ZeRO 1-3): lockstep zero-weighted replay.

Under sharding every rank owns a slice of every parameter, so a rank that has run out of data
cannot simply wait: it must keep taking part in every all-gather of a
forward, every reduce-scatter of a backward and, under DeepSpeed, every collective of the
optimizer step. It does so by *replaying*: the forward on a cached input (its own last batch;
a rank that never had a batch is sent an example by an active rank) and the backward with
zero output gradients, so its contribution to every reduction is exactly zero, while it steps
its own shard with the reduced gradient like everyone else.

One session for every strategy over a process group: DDP (``ddp_join.py``), FSDP2
(``fsdp/join.py``) and DeepSpeed (``deepspeed/join.py``) each supply a small
:class:`Replayer`; the rounds, events and refusals are here. Each round opens with one small SUM all-reduce, the
*opener*, in which ranks that have left the block send zeros and every active rank sends the
same announcement, so the sum divided by the number of active ranks is the announcement:

- FORWARD (which model, grad mode): a forward pre-hook, prepended, so that it runs before the
  backend's own all-gathers;
- BACKWARD (which model, gradient-sync flag, which outputs received a gradient): an identity
  ``autograd.Function`` around the model's outputs, whose backward runs before any backward
  collective. Without it a user collective between forward and backward would meet the
  backward's reduce-scatter on a joined rank;
- STEP (DeepSpeed only: its step is collective) and CLIP (``lite.clip_gradients``: a norm is
  reduced over the ranks);
- COLLECTIVE: one of ``lite.all_reduce``/``all_gather``/``broadcast``/``barrier`` (a header
  all-gather, then the payload with neutral values: ``join_session.ProcessGroupJoin``);
- EVENTS: only when more local events are pending than one opener carries.

Local actions with no collective of their own - ``optimizer.step`` (FSDP), ``zero_grad``,
``scheduler.step`` - are recorded as *events* and carried on the next opener, so they cost no
extra round; a joined rank applies them in order. A rank that has just run out already applied
its own last events: in its first serving round it checks that the active ranks report the
same ones and skips them.

A sum with a count of zero means every rank has left: the block ends on every rank.

What cannot be replayed is refused with an error naming the cause, never left to hang or to
drift: active ranks announcing different things, a learning rate changed by hand, an LR
scheduler stepped at different times on different ranks, ``ReduceLROnPlateau`` (its metric is
not known to a joined rank).
"""

from __future__ import annotations

import contextlib
import gc
import math
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from scopedlite._comm.process_group import broadcast_any
from scopedlite._core.structures import map_tensors
from scopedlite._strategies.join_members import models_in_join
from scopedlite._strategies.join_session import (
    ABORT,
    PEER_LEFT,
    PeerLeftJoinError,
    ProcessGroupJoin,
    refuse_raw_collectives,
)

if TYPE_CHECKING:
    from scopedlite._strategies.base import Strategy

__all__ = ["ReplayJoin", "Replayer", "announce_forwards", "wrap_method"]

# Round kinds.
FORWARD, BACKWARD, STEP, CLIP, COLLECTIVE, EVENTS = 1, 2, 3, 4, 5, 6
_KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", STEP: "optimizer step", CLIP: "clip_gradients", COLLECTIVE: "collective", EVENTS: "events"}

# Event types (code = type + 8 * index of the optimizer or scheduler).
OPT_STEP, ZERO_NONE, ZERO_KEEP, SCHED_STEP = 1, 2, 3, 4
_EVENT_NAMES = {OPT_STEP: "optimizer.step()", ZERO_NONE: "optimizer.zero_grad()", ZERO_KEEP: "optimizer.zero_grad(set_to_none=False)", SCHED_STEP: "scheduler.step()"}

# Opener layout (float64, summed over ranks). The L* fields are the "leaving report": the
# events a rank applied after its last round, sent once when it starts serving.
_COUNT, _KIND, _SIG, _SIG2, _INDEX, _FLAG, _MASK, _NEED, _F0, _F1, _NEV, _LCOUNT, _LNEV, _LSIG, _LSIG2, _NORM = range(16)
_K = 6  # events carried per opener
_EV = 16
_EVV = _EV + _K
_LEV = _EVV + _K
_LEVV = _LEV + _K
_LENGTH = _LEVV + _K
_MAX_OUTPUTS = 48  # output tensors a mask can describe exactly in a float64
_KEPT_FORWARDS = 8  # a joined rank keeps the replayed outputs of this many recent forwards


class Replayer(Protocol):
    """What a sharded strategy supplies to the session: its hooks and its replays."""

    records_steps: bool  # optimizer.step/zero_grad are local events (FSDP), not a round (DeepSpeed)

    def install(self, session: ReplayJoin) -> contextlib.ExitStack:
        """Hook the models so that active ranks announce forwards (and steps); undone on close."""
        ...

    def forward(self, index: int, args: Any, kwargs: Any, sync: bool) -> Any:
        """Run model ``index`` on a joined rank (the hooks see the session serving); ``sync``:
        whether the active ranks' forward prepared a gradient sync (DDP decides it there)."""
        ...

    def backward(self, index: int, outputs: list[torch.Tensor], sync: bool) -> None:
        """Backward through ``outputs`` with zero gradients, syncing gradients or not."""
        ...

    def step(self, index: int) -> None:
        """Take the collective optimizer step of model ``index`` (DeepSpeed)."""
        ...

    def sync_flag(self, index: int) -> bool:
        """Whether the next backward of model ``index`` synchronises gradients."""
        ...

    def active_count(self, count: int) -> None:
        """The number of active ranks is now ``count`` (for ``divide_by_initial_world_size=False``)."""
        ...

    def output_scale(self, count: int) -> float:
        """The factor on the active ranks' output gradients when ``count`` ranks are active
        (1.0 where the strategy divides by the active count itself)."""
        ...

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float | None, clip_val: float | None, norm_type: float) -> Any:
        """The strategy's own ``clip_gradients`` for ``optimizer``."""
        ...


class _Announce(torch.autograd.Function):
    """Identity on a model's outputs; its backward announces the backward to joined ranks."""

    @staticmethod
    def forward(ctx: Any, session: ReplayJoin, index: int, seq: int, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
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


class ReplayJoin(ProcessGroupJoin):
    """The join session of a sharded strategy (see the module docstring)."""

    def __init__(
        self,
        strategy: Strategy,
        replayer: Replayer,
        models: tuple[torch.nn.Module, ...],
        optimizers: tuple[torch.optim.Optimizer, ...],
        divide_by_initial_world_size: bool,
    ) -> None:
        self.strategy = strategy
        self.replayer = replayer
        self.models = models
        self.optimizers = optimizers
        self.joinables = models
        self.divide = divide_by_initial_world_size
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.device = strategy.comm_device
        self.schedulers = _schedulers_of(optimizers)
        self.serving = False
        self.count = self.world_size
        self.pending: list[tuple[int, float]] = []
        self.inputs: dict[int, tuple[Any, Any]] = {}  # model index -> last (args, kwargs)
        self.forwards = 0  # FORWARD rounds so far: the same count on every rank
        self.outputs: dict[int, list[torch.Tensor]] = {}  # forward number -> replayed outputs awaiting backward
        self._lrs = [_lrs(o) for o in optimizers]
        self._in_scheduler = 0
        self._stack = contextlib.ExitStack()

    # -- the block ---------------------------------------------------------------------------
    def __enter__(self) -> ReplayJoin:  # noqa: PYI034
        try:
            self._stack.enter_context(models_in_join(self.strategy.unwrap(m) for m in self.models))  # asked by user methods
            self._stack.enter_context(self.replayer.install(self))
            self._stack.enter_context(refuse_raw_collectives())
            self._hook_optimizers()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:
                self._serve()
            elif isinstance(exc, Exception) and not isinstance(exc, PeerLeftJoinError):
                self._abort_round()
        finally:
            self.inputs.clear()
            self.outputs.clear()
            self._stack.close()

    def _abort_round(self) -> None:
        """Tell the other ranks that this one leaves the block by an exception.

        They wait in an opener (active ranks at their next forward, backward, step or
        collective; ranks that ran out of data while serving) for rounds this rank will never
        open; were it to catch the exception and go on, its next collective would be taken
        for one of the protocol's. One opener whose count no sum of real ones reaches makes
        every rank that reads it raise :class:`PeerLeftJoinError`, all of them in step.
        """
        opener = [0.0] * _LENGTH
        opener[_COUNT] = ABORT
        try:
            dist.all_reduce(torch.tensor(opener, dtype=torch.float64, device=self.device))
        except Exception:  # noqa: BLE001 - the group is broken already: its own error says so
            pass

    def is_active(self) -> bool:
        """Whether this rank is in the loop (not serving the others after its data ran out)."""
        return not self.serving

    # -- active ranks: hooks ---------------------------------------------------------------------
    def before_forward(self, index: int, args: Any, kwargs: Any) -> None:
        """Announce a forward of model ``index`` and remember its input for a later replay."""
        if self.serving:
            return
        self.inputs[index] = (args, kwargs)
        flag = int(torch.is_grad_enabled()) | int(self.replayer.sync_flag(index)) << 1
        total = self._announce(FORWARD, index=index, flag=flag)
        self.forwards += 1
        if total[_NEED] > 0:
            self._exchange_example(index, (args, kwargs))

    def after_forward(self, index: int, output: Any) -> Any:
        """Wrap the outputs that need a gradient in the announcing identity."""
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
        wrapped = iter(_Announce.apply(self, index, self.forwards, *tensors))
        result = map_tensors(output, lambda t: next(wrapped) if t.requires_grad else t)
        if self.serving:
            # Kept until the backward of this forward is announced; a few forwards may come
            # before one backward (two passes, one loss), none is kept for ever.
            self.outputs[self.forwards] = [t for t in _leaves(result) if t.requires_grad]
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
        self._announce(BACKWARD, index=index, flag=int(self.replayer.sync_flag(index)), mask=mask, floats=(0.0, float(seq)))
        return self.replayer.output_scale(self.count)

    def before_step(self, index: int) -> None:
        """Announce a collective optimizer step (DeepSpeed's ``engine.step``)."""
        if self.serving:
            return
        optimizer = self._optimizer_of(index)
        lr = self._check_lr(optimizer) if optimizer is not None else 0.0
        self._announce(STEP, index=index, floats=(lr, 0.0))

    def clip_gradients(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None, clip_val: float | None, norm_type: float = 2.0) -> Any:
        """``lite.clip_gradients`` inside the block: the joined ranks clip their shards too."""
        index = self._index_of_optimizer(optimizer)
        floats = (float(max_norm) if max_norm is not None else -1.0, float(clip_val) if clip_val is not None else -1.0)
        self._announce(CLIP, index=index, flag=int(max_norm is not None), floats=floats, norm_type=norm_type)
        return self.replayer.clip(optimizer, max_norm, clip_val, norm_type)

    def _announce_collective(self) -> None:
        self._announce(COLLECTIVE)

    # -- active ranks: events --------------------------------------------------------------------
    def _hook_optimizers(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            if self.replayer.records_steps:
                handle = optimizer.register_step_post_hook(lambda opt, a, k, i=i: self._record_step(i))
                self._stack.callback(handle.remove)
                self._wrap(optimizer, "zero_grad", self._zero_grad_recorder(i))
        for j, scheduler in enumerate(self.schedulers):
            self._wrap(scheduler, "step", self._scheduler_recorder(j, scheduler))

    def _wrap(self, obj: Any, name: str, make: Any) -> None:
        """Replace ``obj.name`` on the instance for the block; restored on close."""
        wrap_method(self._stack, obj, name, make(getattr(obj, name)))

    def _zero_grad_recorder(self, i: int) -> Any:
        def make(previous: Any) -> Any:
            def zero_grad(set_to_none: bool = True) -> None:
                previous(set_to_none=set_to_none)
                self._record((ZERO_NONE if set_to_none else ZERO_KEEP) + 8 * i)

            return zero_grad

        return make

    def _scheduler_recorder(self, j: int, scheduler: Any) -> Any:
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

        def make(previous: Any) -> Any:
            def step(*args: Any, **kwargs: Any) -> Any:
                if plateau and not self.serving:
                    raise RuntimeError(
                        "ReduceLROnPlateau.step(metric) cannot be called inside lite.join on several "
                        "processes: ranks that ran out of data must mirror it but do not "
                        "know the metric. Call scheduler.step(metric) after the join block."
                    )
                self._in_scheduler += 1
                try:
                    result = previous(*args, **kwargs)
                finally:
                    self._in_scheduler -= 1
                if self._in_scheduler == 0 and not self.serving:
                    self._record(SCHED_STEP + 8 * j)
                    for k, opt in enumerate(self.optimizers):
                        if opt is scheduler.optimizer:
                            self._lrs[k] = _lrs(opt)
                return result

            return step

        return make

    def _record_step(self, i: int) -> None:
        if self.serving:
            return
        self._record(OPT_STEP + 8 * i, self._check_lr(self.optimizers[i]))

    def _record(self, code: int, value: float = 0.0) -> None:
        if not self.serving:
            self.pending.append((code, value))

    def _check_lr(self, optimizer: torch.optim.Optimizer) -> float:
        """Refuse a learning rate changed by hand: ranks that have left would not see it."""
        i = self._index_of_optimizer(optimizer)
        now = _lrs(optimizer)
        if now != self._lrs[i]:
            group = next(g for g, (a, b) in enumerate(zip(now, self._lrs[i])) if a != b)
            raise RuntimeError(
                f"The learning rate of optimizer {i}, param group {group}, changed from "
                f"{self._lrs[i][group]} to {now[group]} inside lite.join without an LR scheduler "
                "created before the block. Ranks that ran out of data step their shards too and "
                "cannot see a change made by hand. Change it with a torch LR scheduler created "
                "before `with lite.join(...)`, or outside the block."
            )
        return math.fsum(now)

    def _optimizer_of(self, index: int) -> torch.optim.Optimizer | None:
        return self.optimizers[index] if index < len(self.optimizers) else None

    def _index_of_optimizer(self, optimizer: torch.optim.Optimizer) -> int:
        for i, known in enumerate(self.optimizers):
            if known is optimizer:
                return i
        raise ValueError(
            "lite.join got an optimizer that was not set up in this run. Set it up with the "
            "model: `model, opt = lite.setup(model, opt)`."
        )

    # -- the opener --------------------------------------------------------------------------------
    def _announce(self, kind: int, index: int = 0, flag: int = 0, mask: int = 0, floats: tuple[float, float] = (0.0, 0.0), norm_type: float = 2.0) -> list[float]:
        while len(self.pending) > _K:  # more local events than one opener carries
            self._send(EVENTS, 0, 0, 0, (0.0, 0.0), 2.0)
        return self._send(kind, index, flag, mask, floats, norm_type)

    def _send(self, kind: int, index: int, flag: int, mask: int, floats: tuple[float, float], norm_type: float) -> list[float]:
        events, self.pending = self.pending[:_K], self.pending[_K:]
        opener = [0.0] * _LENGTH  # built in Python: one tensor op instead of dozens per round
        opener[_COUNT], opener[_KIND], opener[_INDEX], opener[_FLAG], opener[_MASK] = 1.0, kind, index, flag, mask
        opener[_F0], opener[_F1], opener[_NEV], opener[_NORM] = floats[0], floats[1], len(events), norm_type
        for k, (code, value) in enumerate(events):
            opener[_EV + k], opener[_EVV + k] = code, value
        sig = _signature(kind, index, flag, mask, [c for c, _ in events])
        opener[_SIG], opener[_SIG2] = sig, sig * sig
        total = self._reduce(opener)
        self._agree(total)
        self._set_count(round(float(total[_COUNT])))
        return total

    def _reduce(self, opener: list[float]) -> list[float]:
        work = torch.tensor(opener, dtype=torch.float64, device=self.device)
        dist.all_reduce(work)
        total: list[float] = work.tolist()
        if total[_COUNT] < 0:  # a rank left the block by an exception (see _abort_round)
            raise PeerLeftJoinError(PEER_LEFT)
        return total

    def _agree(self, total: list[float]) -> None:
        """All active ranks must have announced the same thing (sum of squares test)."""
        count = float(total[_COUNT])
        if count * float(total[_SIG2]) != float(total[_SIG]) ** 2:
            raise RuntimeError(
                "Inside lite.join the ranks still active announced different steps (e.g. one "
                "ran a forward while another called a collective, or they stepped different "
                "optimizers). Every active rank must run the same sequence of forwards, "
                "backwards, optimizer steps and lite collectives; data-dependent control flow "
                "that differs between ranks cannot be joined."
            )

    def _set_count(self, count: int) -> None:
        if count and count != self.count:
            self.count = count
            self.replayer.active_count(count)

    def _exchange_example(self, index: int, example: tuple[Any, Any] | None) -> tuple[Any, Any]:
        """Send a rank without any batch an input to replay with (once per model and block)."""
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        flags[self.rank] = 0 if self.serving else 1
        dist.all_reduce(flags)
        src = int(flags.nonzero()[0])
        received = broadcast_any(example if self.rank == src else None, src, self.device)
        device = self.strategy.placement.device
        return map_tensors(received, lambda t: t.to(device))  # type: ignore[no-any-return]

    # -- ranks that have left: serving -------------------------------------------------------------
    def _serve(self) -> None:
        self.serving = True
        own_events, self.pending = self.pending, []
        own = [code for code, _ in own_events]
        if len(own) > _K:
            raise RuntimeError(
                f"Inside lite.join this rank called {len(own)} optimizer/scheduler methods after its "
                f"last forward; at most {_K} can be reported to the other ranks. Move them after "
                "the `with lite.join(...)` block."
            )
        first = True
        while True:
            opener = [0.0] * _LENGTH
            opener[_NEED] = float(any(i not in self.inputs for i in range(len(self.models))))
            if first:  # the events this rank took after its last round, for the ranks serving
                opener[_LCOUNT], opener[_LNEV] = 1, len(own)
                for k, (code, value) in enumerate(own_events):
                    opener[_LEV + k], opener[_LEVV + k] = code, value
                sig = _signature(0, 0, 0, 0, own)
                opener[_LSIG], opener[_LSIG2] = sig, sig * sig
            total = self._reduce(opener)
            count = round(float(total[_COUNT]))
            if count == 0:
                # The last ranks left in this round: no active rank carries their last events
                # any more, so the ranks that left earlier take them from the leaving report.
                if not first:
                    for code, value in self._leaving_report(total):
                        self._apply(code, value)
                break
            self._agree(total)
            self._set_count(count)
            kind, index, flag, mask = (round(float(total[f]) / count) for f in (_KIND, _INDEX, _FLAG, _MASK))
            f0, f1 = float(total[_F0]) / count, float(total[_F1]) / count
            events = [(round(float(total[_EV + k]) / count), float(total[_EVV + k]) / count) for k in range(round(float(total[_NEV]) / count))]
            if first:
                events = self._skip_own(own, events)
                first = False
            for code, value in events:
                self._apply(code, value)
            self._replay(kind, index, flag, mask, f0, f1, total[_NORM] / count, total[_NEED])

    def _leaving_report(self, total: list[float]) -> list[tuple[int, float]]:
        leavers = float(total[_LCOUNT])
        if not leavers:
            return []
        if leavers * float(total[_LSIG2]) != float(total[_LSIG]) ** 2:
            raise RuntimeError(
                "Inside lite.join the last ranks to run out of data did different things after "
                "their last batch (optimizer or scheduler calls). Every rank must run the same "
                "code after its last batch inside the block."
            )
        n = round(float(total[_LNEV]) / leavers)
        return [(round(float(total[_LEV + k]) / leavers), float(total[_LEVV + k]) / leavers) for k in range(n)]

    def _skip_own(self, own: list[int], events: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """The events this rank applied itself after its last round are the active ranks' next."""
        reported = [code for code, _ in events]
        if reported[: len(own)] != own:
            raise RuntimeError(
                "Inside lite.join a rank that ran out of data did "
                f"{', '.join(_describe_event(c) for c in own) or 'nothing'} after its last batch, but "
                f"the ranks still active did {', '.join(_describe_event(c) for c in reported) or 'nothing'} "
                "between the same two points. The usual cause is an LR scheduler (or zero_grad) "
                "called after the loop but inside the join block: it then runs at different "
                "times on different ranks. Call it after the `with lite.join(...)` block."
            )
        return events[len(own) :]

    def _apply(self, code: int, value: float) -> None:
        kind, i = code % 8, code // 8
        if kind == OPT_STEP:
            self._compare_lr(self.optimizers[i], value)
            self.optimizers[i].step()
        elif kind in (ZERO_NONE, ZERO_KEEP):
            self.optimizers[i].zero_grad(set_to_none=kind == ZERO_NONE)
        elif kind == SCHED_STEP:
            self.schedulers[i].step()

    def _compare_lr(self, optimizer: torch.optim.Optimizer, value: float) -> None:
        mine = math.fsum(_lrs(optimizer))
        if not math.isclose(mine, value, rel_tol=1e-9, abs_tol=1e-15):
            raise RuntimeError(
                f"Inside lite.join the ranks still active step with learning rate(s) summing to "
                f"{value:.6g}, but rank {self.rank}, which ran out of data, has {mine:.6g}. An LR "
                "scheduler stepped after the loop inside the join block runs early on ranks "
                "that finish early: call it after the `with lite.join(...)` block."
            )

    def _replay(self, kind: int, index: int, flag: int, mask: int, f0: float, f1: float, norm_type: float, need: float) -> None:
        if kind == FORWARD:
            if need > 0:
                example = self._exchange_example(index, None)
                self.inputs.setdefault(index, example)
            args, kwargs = self.inputs[index]
            self.forwards += 1
            with torch.set_grad_enabled(bool(flag & 1)):
                self.replayer.forward(index, args, kwargs, bool(flag & 2))
        elif kind == BACKWARD:
            outputs = self.outputs.pop(round(f1), [])
            chosen = [t for i, t in enumerate(outputs) if mask >> i & 1]
            self.replayer.backward(index, chosen, bool(flag))
        elif kind == STEP:
            optimizer = self._optimizer_of(index)
            if optimizer is not None:
                self._compare_lr(optimizer, f0)
            self.replayer.step(index)
        elif kind == CLIP:
            self.replayer.clip(self.optimizers[index], f0 if flag else None, None if flag else f1, norm_type)
        elif kind == COLLECTIVE:
            self._shadow_ours()
        # EVENTS: the events were the round


def _leaves(output: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    map_tensors(output, lambda t: tensors.append(t))
    return tensors


def _lrs(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    return tuple(float(g["lr"]) if not isinstance(g["lr"], torch.Tensor) else float(g["lr"].item()) for g in optimizer.param_groups)


def _signature(kind: int, index: int, flag: int, mask: int, codes: list[int]) -> int:
    """A small hash of an announcement's integer fields (< 2**20, so its square sums exactly)."""
    value = 7
    for field in (kind, index, flag, mask % 1000003, len(codes), *codes):
        value = (value * 131 + field + 1) % 999983
    return value


def _describe_event(code: int) -> str:
    return f"{_EVENT_NAMES.get(code % 8, '?')} (#{code // 8})"


def _schedulers_of(optimizers: tuple[torch.optim.Optimizer, ...]) -> list[Any]:
    """The LR schedulers built on ``optimizers`` so far, in a deterministic order.

    Schedulers hold their optimizer but the optimizer does not know them; the garbage
    collector's referrers are the one public way to find the ones the user created.
    """
    found: list[tuple[int, str, Any]] = []
    seen: set[int] = set()
    for i, optimizer in enumerate(optimizers):
        referrers = gc.get_referrers(optimizer)
        # An instance whose attributes were ever set on it by name refers through its __dict__.
        owners = [o for d in referrers if isinstance(d, dict) for o in gc.get_referrers(d) if getattr(o, "__dict__", None) is d]
        for referrer in [*referrers, *owners]:
            if isinstance(referrer, torch.optim.lr_scheduler.LRScheduler) and id(referrer) not in seen:
                seen.add(id(referrer))
                found.append((i, type(referrer).__name__, referrer))
    found.sort(key=lambda entry: (entry[0], entry[1]))
    return [scheduler for _, _, scheduler in found]


def announce_forwards(stack: contextlib.ExitStack, session: ReplayJoin, index: int, module: torch.nn.Module) -> None:
    """Open a FORWARD round before each forward of ``module`` (model ``index`` of the
    session) and hand its output to the session, until ``stack`` closes.

    The pre-hook is prepended and registered after the strategy wrapped the module, so it
    runs before the strategy's own (FSDP2's all-gather): a joined rank must hear of the
    forward before it is asked to take part in it.
    """

    def pre(_: Any, args: Any, kwargs: Any) -> None:
        session.before_forward(index, args, kwargs)

    def post(_: Any, args: Any, output: Any) -> Any:
        return session.after_forward(index, output)

    stack.callback(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True).remove)
    stack.callback(module.register_forward_hook(post).remove)


def wrap_method(stack: contextlib.ExitStack, obj: Any, name: str, wrapper: Any) -> None:
    """Set ``obj.name = wrapper`` on the instance until ``stack`` closes."""
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, wrapper)

    def restore() -> None:
        if vars(obj).get(name) is wrapper:
            if had_own:
                setattr(obj, name, previous)
            else:
                delattr(obj, name)

    stack.callback(restore)

