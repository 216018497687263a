"""What every strategy over one torch.distributed process group shares.

DDP, FSDP and DeepSpeed differ in how they wrap modules and optimizers, not in how their
processes meet or how our collectives travel: the backend option and its checks, the start
(bind the GPU, create the group) and stop, the four collectives and the ``join`` template
(one :class:`~scopedlite._strategies.join.session.JoinSession` with a hook per backend) live
here once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scopedlite._comm import distributed as _distributed
from scopedlite._comm.debug import order_check_enabled
from scopedlite._core.structures import map_tensors
from scopedlite._strategies.base import Rendezvous, Strategy
from scopedlite._strategies.join.hook import JoinHook
from scopedlite._strategies.join.members import in_join
from scopedlite._strategies.join.session import JoinSession
from scopedlite._strategies.lockstep import GatherLedger

if TYPE_CHECKING:
    from scopedlite._core.run import Placement

__all__ = ["ProcessGroupStrategy"]

# What lite.join takes beside models: LR schedulers (ReduceLROnPlateau, SequentialLR and
# ChainedScheduler are LRScheduler subclasses since torch 2.2).
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler,)

_BACKENDS = (None, "gloo", "nccl")
_START_METHODS = (None, "script", "fork")


class ProcessGroupStrategy(Strategy):
    """A strategy whose ranks share the default process group.

    Args:
        process_group_backend: ``"gloo"`` or ``"nccl"``; None picks NCCL on CUDA, else gloo.
        start_method: How our launcher starts the other local processes when
            ``launch(launcher="auto")``: ``"script"`` re-executes the command line,
            ``"fork"`` forks (notebooks). None picks by where the code runs.
    """

    # Where the strategy notes each rank's steps (training forwards; under FSDP and ZeRO-3 every
    # gathering step) and our collectives, so that a call on some ranks only is refused, not
    # left to hang (lockstep.py). Made by the strategy's start, let go of in stop.
    _ledger: GatherLedger | None = None

    def __init__(self, process_group_backend: str | None = None, start_method: str | None = None) -> None:
        if process_group_backend not in _BACKENDS:
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is not valid; choose 'gloo', 'nccl' or None."
            )
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not valid; choose one of {_START_METHODS[1:]} or None.")
        self.process_group_backend = process_group_backend
        self.start_method = start_method

    @property
    def launcher(self) -> str | None:  # type: ignore[override]
        return self.start_method

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        if self.process_group_backend == "nccl" and accelerator != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs accelerator='cuda', not {accelerator!r}; "
                "use 'gloo' (or None) on CPU."
            )

    def backend(self, accelerator: str) -> str:
        return self.process_group_backend or super().backend(accelerator)

    @property
    def comm_device(self) -> torch.device:
        return self._comm_device

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        """Bind this process's GPU (if any) and create the run's process group, or join the
        default group that existed before launch."""
        assert rendezvous is not None, f"strategy={self.name!r} needs a rendezvous"
        self.place(placement)
        self.set_up.watch_schedulers()  # lite.join steps them on ranks that ran out of data
        existing = rendezvous.world.is_existing_group  # made before launch: joined, kept
        if existing:
            self._backend, self.connection = _distributed.adopt_existing_group(
                rendezvous.world, self.process_group_backend, placement.accelerator
            )
        else:
            self._backend = self.backend(placement.accelerator)
        self._comm_device = _distributed.comm_device(self._backend, placement.device)
        self._join_group: Any = None
        if placement.accelerator == "cuda":
            torch.cuda.set_device(placement.device)
        if not existing:
            self.connection = _distributed.init_process_group(
                self._backend,
                rendezvous.world,
                timeout=placement.timeout,
                store=rendezvous.store,
                device=placement.device,
            )

    def stop(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
        super().stop()
        self._join_group = None
        if self.connection is not None:
            _distributed.destroy_process_group(self.connection)
            self.connection = None

    def block_body_ended(self) -> None:
        if self._ledger is not None:
            self._ledger.leave_block()

    def waiting_at_end(self) -> None:
        if self._ledger is not None and order_check_enabled():  # SCOPEDLITE_ORDER_CHECK=0: off
            self._ledger.waiting_at_end()

    # -- collectives over the default group ---------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self.note_collective()
        return _distributed.all_reduce_tensor(tensor, op, self._comm_device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.note_collective()
        return _distributed.all_gather_tensor(tensor, self._comm_device)

    def broadcast(self, obj: Any, src: int) -> Any:
        self.note_collective()
        result = _distributed.broadcast_any(obj, src, self._comm_device)
        return map_tensors(result, lambda t: t.to(self.placement.device))

    def barrier(self) -> None:
        self.note_collective()
        _distributed.barrier(self._backend, self.placement.device)

    def join_left(self) -> None:
        """Every rank left a ``lite.join`` block together (the gather ledger's counts, kept by
        its own scope around the block, start again on every way out: lockstep.py)."""

    def every_rank_calls(self, call: str, why: str, fix: str, alone: str | None = None) -> None:
        """Where the strategy keeps a gather ledger (all but xla), ``call`` made on some ranks
        only (``if run.is_global_zero: lite.save(...)``) raises ``MethodCalledOnSomeRanksError``
        there at once: its first collective would meet the others' next step, and the run
        would abort or wait until the watchdog or the timeout ends it."""
        if self._ledger is not None:
            self._ledger.every_rank_calls(call, why, fix, alone)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self._note_backward()
        super().backward(loss, *args, **kwargs)

    def _note_forward(self) -> None:
        """Under ddp and ZeRO-0/1/2, whose forwards gather nothing, a training forward is noted
        in the gather ledger (outside ``lite.join``), for :meth:`every_rank_calls`."""
        if self._ledger is not None:
            self._ledger.forward(joined=in_join())

    def _note_backward(self) -> None:
        """Under fsdp, model_parallel and ZeRO-3, a backward outside ``lite.join`` is noted in
        the gather ledger: a rank that skipped it is refused at its next forward, before that
        forward's gathers meet this backward's (lockstep.py)."""
        if self._ledger is not None and not in_join():
            self._ledger.backward()

    def collective_called(self, call: str) -> None:
        if self._ledger is not None:
            self._ledger.users_collective(call)

    def cannot_go_on(self, reason: str) -> None:
        """The join protocol cannot bring this rank back in step with the others (``reason``):
        the gather ledger refuses every later step of this rank, and the end of its block."""
        if self._ledger is not None:
            self._ledger.cannot_go_on(reason)

    def note_collective(self) -> None:
        """A rank gathering alone learns from the ledger that this one waits in a collective."""
        if self._ledger is not None:
            self._ledger.collective()

    # -- lite.join: one template, a hook per backend -------------------------------------
    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> JoinSession:
        """``lite.join`` by lockstep zero-weighted replay (see ``_strategies/join/session.py``).

        ``joinables`` are set-up models and, optionally, LR schedulers: the run knows those
        built while it is active already; one built before ``lite.launch`` is named here."""
        models = self.join_models()
        chosen_models = []
        for joinable in joinables:
            if isinstance(joinable, _SCHEDULERS):
                self.set_up.add_scheduler(joinable)
            elif any(joinable is m for m in models):
                chosen_models.append(joinable)
            else:
                raise TypeError(
                    f"lite.join takes the models returned by lite.setup (and LR schedulers), got a "
                    f"{type(joinable).__name__} that was not set up in this run. Use "
                    "`model = lite.setup(model)` (or `model, opt = lite.setup(model, opt)`) and "
                    "then `with lite.join(model):`."
                )
        chosen = tuple(chosen_models) or tuple(models)
        optimizers = self.join_optimizers(chosen)
        hook = self.join_hook(chosen, optimizers, divide_by_initial_world_size)
        ledger = self._ledger.inside_join() if self._ledger is not None else None
        return JoinSession(self, hook, chosen, optimizers, self._rounds_group(), self.join_replicas(), ledger)

    def join_models(self) -> list[torch.nn.Module]:
        """The models set up in this run and still referenced, in setup order."""
        raise NotImplementedError

    def join_optimizers(self, models: tuple[torch.nn.Module, ...]) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers a join over ``models`` mirrors, in setup order."""
        raise NotImplementedError

    def join_hook(
        self, models: tuple[Any, ...], optimizers: tuple[torch.optim.Optimizer, ...], divide_by_initial_world_size: bool
    ) -> JoinHook:
        """This backend's hooks and replays (checks what it cannot replay first)."""
        raise NotImplementedError

    def join_replicas(self) -> tuple[int, ...]:
        """The data-parallel replica of each rank (``[r]``: rank ``r``'s): the ranks of one
        replica read the same batches and run out of data together. Each rank is a replica
        of its own, unless the strategy splits a replica over several (``model_parallel``)."""
        return tuple(range(self.placement.world_size))

    @staticmethod
    def optimizers_of(models: tuple[torch.nn.Module, ...], optimizers: list[Any]) -> tuple[torch.optim.Optimizer, ...]:
        """Of the run's live optimizers (weak references), those that update ``models``: one
        of a model dropped earlier may still await the garbage collector on one rank and not
        on another, and every rank must mirror the same ones."""
        params = {id(p) for model in models for p in model.parameters()}
        return tuple(
            o
            for o in optimizers
            if o is not None and any(id(p) in params for group in o.param_groups for p in group["params"])
        )

    def _rounds_group(self) -> Any:
        """Where the join protocol's rounds travel: a CPU group, so that no round waits for
        the device (under NCCL a gloo group beside it, created at the first join)."""
        if self._backend != "nccl":
            return None
        if self._join_group is None:
            self._join_group = dist.new_group(backend="gloo")
        return self._join_group
