"""torch.distributed plumbing shared by the multi-process strategies.

Process-group creation and teardown (with the rendezvous store), and the four collectives on
plain tensors: reductions that return a new tensor (the input is never modified), gathers
stacked on a new leading dimension, and a broadcast that needs nothing of the receivers (they
may pass None) because the source first sends a small header describing what follows. Objects
travel as pickled bytes rather than through ``broadcast_object_list``, which needs numpy on the
receiving ranks in torch 2.13.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from scopedlite._cluster.environments import World
from scopedlite._comm.payloads import keep
from scopedlite._comm.wire import DTYPES, MAX_DIMS, TORCH_OPS, from_bytes, to_bytes, wire_dtype
from scopedlite._core.process import this_process
from scopedlite._private.torch_internals import (
    default_store,
    forget_dtensor_shardings,
    live_process_groups,
    set_group_timeout,
)

__all__ = [
    "Connection",
    "adopt_existing_group",
    "all_gather_tensor",
    "all_reduce_tensor",
    "barrier",
    "broadcast_any",
    "gather_into_later",
    "init_process_group",
    "retire_groups",
    "run_store",
    "store_connection",
]


@dataclass
class Connection:
    """What this process holds of its run's default process group: made by
    :func:`init_process_group` or :func:`adopt_existing_group`, kept by the run's strategy
    (``strategy.connection``) and handed back to :func:`destroy_process_group`. Nothing of it
    lives in this module, so a later run in the process (a notebook's next cell) starts with
    none of an earlier one's.

    Attributes:
        store: The store of a run our launcher started (rank 0 hosts it), which the ranks
            also meet through at the end of a block; None elsewhere.
        hosted: The store this process made for a world of SLURM, MPI & co. (rank 0 hosts
            it), with this rank and the world size: released when every rank let go of it.
        adopted: The group existed before launch and stays its maker's.
    """

    store: Any = None
    hosted: tuple[Any, int, int] | None = None
    adopted: bool = False


def init_process_group(
    backend: str,
    world: World,
    *,
    timeout: datetime.timedelta,
    store: Any = None,
    device: torch.device | None = None,
) -> Connection:
    """Create the default process group of ``world``; the returned connection is what
    :func:`destroy_process_group` undoes.

    - ``store`` given: rank 0 of a world our launcher started, which hosts the store.
    - a torchelastic world: torch reads torchrun's environment (``env://``, agent store).
    - a worker of ours: a client of rank 0's store, announcing itself with a key.
    - any other world (SLURM, MPI, ...): rank 0 hosts a store at the world's main address.

    No environment variable is written: a launch leaves ``os.environ`` as it found it.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "A torch.distributed process group already exists in this process. scopedlite "
            "creates and destroys its own: call torch.distributed.destroy_process_group() "
            "before lite.launch(...), or let the launch make it."
        )
    forget_dtensor_shardings()  # DTensor used before launch, copied into a forked worker (see there)
    kwargs: dict[str, Any] = {}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init bound to this rank's GPU
    rank, size = world.global_rank, world.world_size
    ours = world.is_ours
    collective_timeout = timeout
    if ours:
        # Meeting the other ranks is bounded by the start-up limit, not by launch(timeout=):
        # a rank may still be importing torch while another one waits to connect.
        timeout = max(timeout, start_timeout())
    connection = Connection()
    if store is None and world.is_torchelastic:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=timeout, **kwargs)
        return connection
    if store is None:
        is_host = not ours and rank == 0
        store = dist.TCPStore(world.main_address, world.main_port, size, is_master=is_host, timeout=timeout)
        if not ours:
            connection.hosted = (store, rank, size)
        else:
            # Tell rank 0 we are here: it waits for these keys in Python, where a worker that
            # died before joining can be noticed, instead of inside torch's blocking rendezvous.
            store.set(ready_key(rank), "1")
    if ours:
        connection.store = store
    hook = sys.excepthook
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kwargs)
    if ours:
        try:
            set_group_timeout(collective_timeout)  # from here on, collectives wait launch(timeout=)
        except BaseException:
            dist.destroy_process_group()  # the caller never holds this connection: nothing is left
            raise
        # torch replaces sys.excepthook with one that prefixes every line with "[rankN]:", for
        # good. Rank 0 of a run we start is the user's own process and stays unprefixed; our
        # workers prefix their lines themselves ("[rank N] ", scopedlite._launch.output).
        sys.excepthook = hook
    return connection


def adopt_existing_group(world: World, requested: str | None, accelerator: str) -> tuple[str, Connection]:
    """Take part in the default process group that existed before ``launch`` (``world``
    describes it); return the backend our collectives use on ``accelerator`` and the
    connection to hand to :func:`destroy_process_group`.

    The group stays its maker's: :func:`destroy_process_group` leaves it in place.

    Raises:
        ValueError: ``requested`` (``process_group_backend=``) is not the group's backend.
    """
    assert world.is_existing_group
    if not dist.is_initialized() or (dist.get_rank(), dist.get_world_size()) != (world.global_rank, world.world_size):
        raise RuntimeError(
            f"The default process group launch was to join (rank {world.global_rank} of "
            f"{world.world_size}) was destroyed or replaced while launch was starting."
        )
    backend = str(dist.get_backend())
    # A device-aware group (init_process_group() with no backend) is "cpu:gloo,cuda:nccl".
    per_device = dict(part.split(":", 1) for part in backend.split(",")) if ":" in backend else {}
    chosen = per_device.get("cuda" if accelerator == "cuda" else "cpu") if per_device else backend
    if chosen is None:
        raise ValueError(
            f"The default process group that exists already has backends {backend!r}, none for "
            f"accelerator={accelerator!r}. Create it with a backend for that device."
        )
    if requested is not None and requested != chosen:
        raise ValueError(
            f"process_group_backend={requested!r}, but the default process group that exists "
            f"already (made before launch, which joins it and never replaces it) uses {chosen!r}. "
            f"Remove process_group_backend=, or create the group with backend={requested!r}."
        )
    return chosen, Connection(adopted=True)


START_TIMEOUT_ENV = "SCOPEDLITE_START_TIMEOUT"
_DEFAULT_START_TIMEOUT = datetime.timedelta(minutes=30)


def start_timeout() -> datetime.timedelta:
    """How long the ranks of a run we start may take to reach ``launch`` and meet.

    Separate from ``launch(timeout=)``, which bounds collectives: a short collective timeout
    must not fail a start-up that imports torch or prepares data. ``SCOPEDLITE_START_TIMEOUT``
    (seconds) sets it; the default is 30 minutes. A worker that exits or fails before it
    arrives is reported at once, whatever this limit is.
    """
    value = os.environ.get(START_TIMEOUT_ENV, "").strip()
    if not value:
        return _DEFAULT_START_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{START_TIMEOUT_ENV}={value!r} is not valid: it must be a positive number of seconds.")
    return datetime.timedelta(seconds=seconds)


def ready_key(rank: int) -> str:
    return f"scopedlite/ready/{rank}"


def store_connection(world: World, connection: Connection | None) -> Any:
    """A connection of this process's own to the store every rank of ``world`` shares, for a
    thread that must not queue behind the main thread's blocking store waits (a client's
    operations run one at a time); the shared one (:func:`run_store`) where the world's store
    address is not known to be a store (a group made before launch)."""
    hosted = connection is not None and connection.hosted is not None
    if not world.is_existing_group and world.main_port and (world.is_ours or world.is_torchelastic or hosted):
        try:
            return dist.TCPStore(
                world.main_address,
                world.main_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=30),
                wait_for_workers=False,
            )
        except Exception:  # noqa: BLE001 - fall back to the connection the group uses
            pass
    return run_store(connection)


def run_store(connection: Connection | None) -> Any:
    """The store every rank of the run on ``connection`` shares: the one of a run we started,
    else the default group's (torchrun's agent store, SLURM's or MPI's that rank 0 hosts, a
    group made before launch); None without a process group."""
    if connection is not None and connection.store is not None:
        return connection.store
    if not dist.is_initialized():
        return None
    try:
        return default_store()
    except (RuntimeError, ValueError):
        return None


def end_of_block_barrier(
    connection: Connection | None, rank: int, size: int, seconds: float, check: Callable[[], None] | None = None
) -> bool:
    """Wait until every rank of a run we started reached the end of its launch block.

    Through the store, not a collective: a rank that skipped a collective the others are in
    must not meet them in this barrier, where a collective of another kind would answer
    theirs (gloo then breaks the connection). Waiting here, it leaves them to time out in
    their collective, which names where everyone was. Polled from Python, so rank 0 can be
    interrupted when a worker fails; ``check``, called at every poll, may raise to give up
    (rank 0 raises there when a worker has failed, since a rank that is gone never arrives).
    Returns False where there is no such store (the caller falls back to a collective
    barrier); raises ``TimeoutError`` naming the missing ranks.
    """
    if connection is None or connection.store is None:
        return False
    store = connection.store
    store.set(f"scopedlite/block-end/{rank}", "1")
    keys = [f"scopedlite/block-end/{r}" for r in range(size)]
    deadline = time.monotonic() + seconds
    pause = 0.001
    while not store.check(keys):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise _not_at_end(seconds, [r for r, key in enumerate(keys) if not store.check([key])])
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


def block_end_prefix(store: Any, size: int) -> str:
    """The keys of this launch block's :func:`meet_at_block_end`, in a world someone else
    started, whose store outlives the block (torchrun's agent's, SLURM's or MPI's rank 0's):
    called once by every rank as the block starts (a rank that raises in it skips the end),
    so the counter gives every rank the same prefix."""
    generation = (int(store.add("scopedlite/block-end/count", 1)) - 1) // size
    return f"scopedlite/block-end/{generation}"


def meet_at_block_end(store: Any, prefix: str, rank: int, size: int, seconds: float, check: Callable[[], None]) -> None:
    """Wait until every rank of a world someone else started reached the end of its launch
    block (``prefix``: :func:`block_end_prefix`), through the store, polled from Python.

    As :func:`end_of_block_barrier` does for a run we started, with what a large world needs:
    one counter and one "everyone" key, so a poll reads one key, at most ten times a second;
    and only the first rank to arrive calls ``check`` (it may raise: a rank that went on past
    this end, ``Strategy.waiting_at_end``), so the others' lines are read by one rank, not by
    every rank that waits. Every rank that arrives ended its block before any rank that went on
    would have, so the first to arrive is one that stopped early. Raises ``TimeoutError``
    naming the missing ranks after ``seconds``."""
    store.set(f"{prefix}/{rank}", "1")
    everyone = f"{prefix}/everyone"
    arrived = int(store.add(f"{prefix}/arrived", 1))
    if arrived == size:
        store.set(everyone, "1")
        return
    deadline = time.monotonic() + seconds
    pause = 0.001
    while not store.check([everyone]):
        if arrived == 1:
            check()
        if time.monotonic() > deadline:
            raise _not_at_end(seconds, [r for r in range(size) if not store.check([f"{prefix}/{r}"])])
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _not_at_end(seconds: float, missing: list[int]) -> TimeoutError:
    return TimeoutError(
        f"Timed out after {seconds:.0f} s at the end of the launch block waiting for "
        f"rank(s) {missing}, which did not get there (launch(timeout=))."
    )


def retire_groups() -> None:
    """Hold this run's groups for the life of the process; call it before the default group
    is destroyed, by us or by a library (DeepSpeed).

    A user object may keep a group past its run (a DDP model in a notebook's namespace: its
    reducer holds it); a worker forked for a later block inherits that object, and were the
    worker to drop it, the group's destructor would wait on the gloo threads of the parent,
    which a child does not have: the worker hangs (a notebook cell that assigns ``model`` again
    in a second launch block). Held by the process (``this_process.retired_groups``,
    ``_core/process.py``), no forked copy is ever the last owner. Each costs the parent a few
    idle threads. Not for NCCL: a run on it used CUDA, after which launch refuses to fork. Each
    is held with the pid of the process that retired it, and let go by that process at its
    exit (``_let_go_at_exit``).
    """
    if dist.is_initialized() and "nccl" not in str(dist.get_backend()):  # NCCL: fork is refused
        this_process.retired_groups.extend((os.getpid(), group) for group in live_process_groups())


@atexit.register
def _let_go_at_exit() -> None:
    """Free the groups this process retired while the interpreter still runs.

    Held until the interpreter's own teardown, a gloo group was freed there: its worker
    threads free tensors Python also saw, which takes the GIL of an interpreter that is
    finalizing, and the process died with ``terminate called without an active exception``
    (SIGABRT) after its block had ended well (seen intermittently under torchrun, torch 2.13).
    A forked worker keeps the groups it inherited (freeing them would wait on its parent's
    threads) and lets go of its own.
    """
    pid = os.getpid()
    held = this_process.retired_groups
    held[:] = [(owner, group) for owner, group in held if owner != pid]


def destroy_process_group(connection: Connection) -> None:
    """End the run's process group made on ``connection``, unless it existed before
    ``launch``: that one is its maker's (Ray Train, a framework, the script), and stays."""
    connection.store = None
    if connection.adopted:
        return
    if dist.is_initialized():
        retire_groups()
        dist.destroy_process_group()
    forget_dtensor_shardings()  # their meshes name the groups just destroyed
    if connection.hosted is not None:
        _release_store(*connection.hosted)
        connection.hosted = None


def _release_store(store: Any, rank: int, size: int, seconds: float = 10.0) -> None:
    """Tear down a store we host only after every rank has let go of it.

    Rank 0 hosting the store and leaving first would cut the others' connections while they
    are still closing theirs (seen: an intermittent ``terminate called`` abort under mpirun).
    """
    try:
        store.add("scopedlite/released", 1)
        deadline = time.monotonic() + seconds
        while rank == 0 and store.add("scopedlite/released", 0) < size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - a peer already gone: nothing left to wait for
        pass


def comm_device(backend: str, device: torch.device) -> torch.device:
    """Where tensors must live to be communicated: NCCL needs CUDA, gloo takes CPU."""
    return device if backend == "nccl" else torch.device("cpu")


def all_reduce_tensor(tensor: torch.Tensor, op: str, device: torch.device, group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks; ``mean`` divides the sum by the world size."""
    original = tensor
    work = tensor.detach().to(device=device, dtype=wire_dtype(tensor.dtype, op), copy=True)
    dist.all_reduce(work, op=TORCH_OPS[op], group=group)
    keep(work)  # freed here, not by gloo's thread (payloads.py)
    if op == "mean":
        work = work / dist.get_world_size(group)
    elif original.dtype == torch.bool and op in ("max", "min"):
        work = work.bool()
    return work.to(original.device)


def all_gather_tensor(tensor: torch.Tensor, device: torch.device, group: Any = None) -> torch.Tensor:
    """Gather ``tensor`` from all ranks, stacked on a new leading dimension (rank order)."""
    work = tensor.detach().to(device).contiguous()
    parts = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, work, group=group)
    keep(work, *parts)
    return torch.stack(parts).to(tensor.device)


def gather_into_later(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> Callable[[], None]:
    """Start gathering every rank's ``tensor`` into ``output``, concatenated in rank order,
    without waiting for it: the function returned waits for it (and must be called: until then
    gloo's thread holds both tensors). torch's ``all_gather_single`` (2.13; it deprecates
    ``all_gather_into_tensor`` with a warning on every call), ``all_gather_into_tensor`` on
    older torch."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(output, tensor, group=group, async_op=True)

    def wait() -> None:
        work.wait()
        keep(output, tensor)  # freed here, not by gloo's thread (payloads.py)

    return wait


def final_gloo_barrier() -> bool:
    """The last barrier of a process over a gloo group; False where the group is not gloo.

    ``dist.barrier`` on gloo runs in the group's worker thread and keeps the collectives queued
    before it alive until that thread frees it, after the barrier has returned. Freeing a
    tensor that Python also saw takes the GIL; right before exit the interpreter may already be
    finalizing, and the worker thread then dies inside a destructor: ``terminate called without
    an active exception`` (SIGABRT), seen intermittently on torch 2.13 under torchrun. gloo's
    ``monitored_barrier`` sends and receives on the calling thread with a tensor of its own.
    """
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return False
    dist.monitored_barrier(wait_all_ranks=True)
    return True


def barrier(backend: str, device: torch.device, group: Any = None) -> None:
    if backend == "nccl":
        dist.barrier(group=group, device_ids=[device.index or 0])
    else:
        dist.barrier(group=group)


_HEADER = 3 + MAX_DIMS  # kind, dtype code, ndim, shape...
_KIND_TENSOR, _KIND_BYTES = 1, 2


def broadcast_any(obj: Any, src: int, device: torch.device, group: Any = None) -> Any:
    """Send ``obj`` from rank ``src`` to every rank and return it everywhere.

    Tensors travel as tensors and arrive on each rank's device; anything else is pickled
    (tensors inside it are moved to CPU first, then back to each rank's device).
    """
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    payload: torch.Tensor | None = None
    if dist.get_rank(group) == src:
        if isinstance(obj, torch.Tensor) and obj.dim() <= MAX_DIMS and obj.dtype in DTYPES:
            payload = obj.detach().to(device).contiguous()
            header[0], header[1], header[2] = _KIND_TENSOR, DTYPES.index(obj.dtype), obj.dim()
            header[3 : 3 + obj.dim()] = torch.tensor(obj.shape, dtype=torch.int64)
        else:
            payload = to_bytes(obj).to(device)
            header[0], header[1], header[2] = _KIND_BYTES, DTYPES.index(torch.uint8), 1
            header[3] = payload.numel()
    dist.broadcast(header, src=src, group=group)
    keep(header)
    kind, dtype, ndim = (int(v) for v in header[:3].tolist())
    shape = [int(v) for v in header[3 : 3 + ndim].tolist()]
    if payload is None:
        payload = torch.empty(shape, dtype=DTYPES[dtype], device=device)
    dist.broadcast(payload, src=src, group=group)
    keep(payload)
    if kind == _KIND_TENSOR:
        return payload.clone() if dist.get_rank(group) == src else payload
    return from_bytes(payload)
