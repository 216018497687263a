"""Turning the arguments of ``launch`` into a frozen plan, before anything starts.

:func:`resolve` is the one place where arguments meet the environment. It is pure: it reads
the arguments, a mapping of environment variables and a :class:`Machine` description, and
returns a :class:`Plan` or raises. It runs in named steps, each below in the order it runs:

1. :func:`_command_line`: the options of ``python -m scopedlite run`` merged into the
   arguments (:class:`_Arguments`, as written);
2. :meth:`_Request.validate`: every argument validated on its own;
3. :func:`_existing_world`: the world this process is already a member of, if any;
4. :func:`_pick_accelerator` and :func:`_check_precision`: the accelerator, and the precision
   on it;
5. :func:`_size`: the devices of this node, the nodes and the world size, reconciled with
   an existing world;
6. :func:`_strategy_for`: the strategy, checked against all of the above;
7. :func:`_launcher_for`: how the processes come to be.

Nothing the user asked for is silently replaced by something else.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping, Sequence, get_args

from scopedlite._cluster.environments import World, detect_world, existing_group_world
from scopedlite._core.precision import Precision, precision_for
from scopedlite._hardware.machine import Machine
from scopedlite._loggers.base import Logger, check_loggers
from scopedlite._strategies.base import Strategy
from scopedlite._strategies.registry import STRATEGIES

__all__ = ["ACCELERATORS", "COMMAND_LINE", "LAUNCHERS", "Launcher", "LauncherMode", "Plan", "resolve"]

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu", "xla")
#: What ``launch(launcher=...)`` accepts.
Launcher = Literal["auto", "script", "fork"]
LAUNCHERS: tuple[Launcher, ...] = get_args(Launcher)
#: What the plan does: run in this one process, start the others by re-executing the script
#: or by forking, or join a world that exists already.
LauncherMode = Literal["none", "script", "fork", "join"]
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# The variables ``python -m scopedlite run --accelerator ... --precision ...`` sets for the
# script it starts, one per ``launch`` argument it configures (see _command_line below).
COMMAND_LINE = {
    "accelerator": "SCOPEDLITE_CLI_ACCELERATOR",
    "strategy": "SCOPEDLITE_CLI_STRATEGY",
    "devices": "SCOPEDLITE_CLI_DEVICES",
    "num_nodes": "SCOPEDLITE_CLI_NUM_NODES",
    "precision": "SCOPEDLITE_CLI_PRECISION",
}


DEFAULT_HANG_TIMEOUT = 120.0  # SPEC 9: a desync is reported within 2 minutes
DEFAULT_TERM_GRACE = 30.0  # as torchrun, SLURM (KillWait) and Kubernetes give after SIGTERM


@dataclass(frozen=True)
class Plan:
    """Everything ``launch`` will do, decided before it does any of it.

    Attributes:
        accelerator: ``"cpu"``, ``"cuda"``, ``"mps"`` or ``"xla"`` (asked for as ``"tpu"``
            or ``"xla"``).
        strategy: The configured strategy (each launch works on a fresh copy of it).
        precision: The precision setting.
        devices: Device indices used on this node, one process each (CPU: 0..n-1).
        num_nodes: Number of nodes.
        world_size: Number of processes in the run.
        launcher: ``"none"`` (one process), ``"script"`` (re-execute the command line),
            ``"fork"``, or ``"join"`` (the world exists already: see ``world``).
        timeout: How long collectives wait for other ranks.
        world: The existing world joined when ``launcher == "join"``.
        loggers: Where ``lite.log`` writes, on global rank 0.
        hang_timeout: Seconds every rank may wait for the others, with nothing moving,
            before the run is ended as stalled (``SCOPEDLITE_HANG_TIMEOUT``); None: never.
        term_grace: Seconds a run whose ranks all wait in a collective has after a SIGTERM
            before it is ended (``SCOPEDLITE_TERM_GRACE``); None: never.
    """

    accelerator: str
    strategy: Strategy = field(compare=False)
    precision: Precision
    devices: tuple[int, ...]
    num_nodes: int
    world_size: int
    launcher: LauncherMode
    timeout: datetime.timedelta
    world: World | None = None
    loggers: tuple[Logger, ...] = field(default=(), compare=False)
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT
    term_grace: float | None = DEFAULT_TERM_GRACE

    @property
    def local_world_size(self) -> int:
        return len(self.devices)


def resolve(
    *,
    accelerator: Any = "auto",
    strategy: Any = "auto",
    devices: Any = "auto",
    num_nodes: Any = None,
    precision: Any = "32-true",
    launcher: Any = "auto",
    timeout: Any = None,
    loggers: Any = None,
    env: Mapping[str, str],
    machine: Machine,
) -> Plan:
    """Validate the arguments of ``launch`` and decide what it will do.

    ``env`` may hold the options of ``python -m scopedlite run`` (:data:`COMMAND_LINE`): an
    argument left at its default takes the command line's value; one set to another value
    that differs from the command line's is an error naming both.
    """
    written = _command_line(
        _Arguments(
            accelerator=accelerator,
            strategy=strategy,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            launcher=launcher,
            timeout=timeout,
            loggers=loggers,
        ),
        env,
    )
    request = _Request.validate(written)
    world = _existing_world(written, env, machine)
    chosen_accelerator = _pick_accelerator(request.accelerator, request.devices, machine)
    _check_precision(request, chosen_accelerator)
    size = _size(request, chosen_accelerator, machine, world)
    chosen_strategy = _strategy_for(request, chosen_accelerator, size, world)
    mode = _launcher_for(request, chosen_strategy, world, machine)
    return Plan(
        accelerator=chosen_accelerator,
        strategy=chosen_strategy,
        precision=request.precision,
        devices=size.devices,
        num_nodes=size.num_nodes,
        world_size=size.world_size,
        launcher=mode,
        timeout=request.timeout,
        world=world,
        loggers=request.loggers,
        hang_timeout=_seconds_or_off(env, HANG_TIMEOUT_ENV, DEFAULT_HANG_TIMEOUT),
        term_grace=_seconds_or_off(env, TERM_GRACE_ENV, DEFAULT_TERM_GRACE),
    )


HANG_TIMEOUT_ENV = "SCOPEDLITE_HANG_TIMEOUT"
TERM_GRACE_ENV = "SCOPEDLITE_TERM_GRACE"
_OFF = ("0", "off", "none", "false", "no")


def _seconds_or_off(env: Mapping[str, str], name: str, default: float) -> float | None:
    """A number of seconds from the environment variable ``name``; 0/off disables (None)."""
    text = env.get(name, "").strip()
    if not text:
        return default
    if text.lower() in _OFF:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"{name}={text!r} is not valid: give a positive number of seconds (default {default:g}), "
            f"or 0/off to turn it off, e.g. `export {name}={default:g}`."
        )
    return seconds


# -- 1. the arguments as written, merged with the command line ------------------------------


@dataclass(frozen=True)
class _Arguments:
    """The arguments of ``launch`` as written: in the script, or, for the five of
    :data:`COMMAND_LINE`, by ``python -m scopedlite run`` when the script leaves them out.
    Error messages quote these. The defaults are ``launch``'s."""

    accelerator: Any = "auto"
    strategy: Any = "auto"
    devices: Any = "auto"
    num_nodes: Any = None
    precision: Any = "32-true"
    launcher: Any = "auto"
    timeout: Any = None
    loggers: Any = None


_DEFAULTS = _Arguments()


def _command_line(arguments: _Arguments, env: Mapping[str, str]) -> _Arguments:
    """Merge the script's ``launch`` arguments with the options of ``python -m scopedlite run``.

    The rule: an argument equal to its default (written out or not) takes the command line's
    value, so a bare ``lite.launch()`` is configured from the command line the way a bare
    ``Fabric()`` is by ``fabric run``. An argument set to anything else must agree with the
    command line: a strategy instance agrees with the name of its class (the script's
    instance, with its options, is used), a list of device indices with a count of the same
    length. Anything else is a contradiction, and silently preferring either side would run
    something one of them did not ask for.
    """
    taken: dict[str, Any] = {}
    for name, variable in COMMAND_LINE.items():
        text = env.get(variable)
        if text is None:
            continue
        flag = "--" + name.replace("_", "-")
        try:
            given = _parse_command_line(name, text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{variable}={text!r} (python -m scopedlite run {flag}) is not valid: {e}") from e
        value = getattr(arguments, name)
        if _is_default(name, value):
            taken[name] = given
        elif not _agrees(name, value, given):
            raise ValueError(
                f"launch({name}={value!r}) in the script contradicts `python -m scopedlite run "
                f"{flag} {text}`. Remove {name}= from the launch call to take the command "
                f"line's value, or make the two agree."
            )
    return replace(arguments, **taken)


def _is_default(name: str, value: Any) -> bool:
    if name == "precision":
        return _precision_name(value) == _DEFAULTS.precision  # 32 and "32" are "32-true" written short
    return isinstance(value, (str, type(None))) and value == getattr(_DEFAULTS, name)


def _precision_name(value: Any) -> Any:
    """The precision ``value`` names (Fabric's short spellings included), or ``value`` itself
    when it names none (the resolver then says so)."""
    try:
        return precision_for(value).name
    except ValueError:
        return value


def _parse_command_line(name: str, text: str) -> Any:
    if name == "accelerator":
        return _check_accelerator(text)
    if name == "strategy":
        return _check_strategy(text)
    if name == "devices":
        return _check_devices(text)
    if name == "num_nodes":
        return _check_positive_int("num_nodes", int(text))
    return precision_for(text).name


def _agrees(name: str, value: Any, given: Any) -> bool:
    if name == "strategy":
        if isinstance(value, Strategy):
            # the name of the instance's own kind: a ModelParallelStrategy is an FSDPStrategy
            # subclass, yet `--strategy fsdp` does not describe it
            kinds = [entry for entry in STRATEGIES.values() if entry.is_kind_of(value)]
            own = max(kinds, key=lambda entry: len(entry.cls.__mro__), default=None)
            return given != "auto" and own is not None and own.where == STRATEGIES[given].where
        return value == given or (
            value in STRATEGIES and given in STRATEGIES and STRATEGIES[value] == STRATEGIES[given]
        )
    if name == "devices":
        if isinstance(value, (list, tuple)) and isinstance(given, int):
            return len(value) == given
        if isinstance(value, str) and value.strip().isdigit():
            return int(value) == given
    if name == "precision":
        return bool(_precision_name(value) == given)
    return bool(value == given)


# -- 2. every argument on its own ----------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    """What the arguments ask for, each validated on its own; nothing is decided yet.

    ``accelerator``, ``strategy`` and ``devices`` may still be ``"auto"``; ``num_nodes`` is
    None when not given. ``written`` is what they were validated from.
    """

    accelerator: str
    strategy: Strategy | str
    devices: str | int | tuple[int, ...]
    num_nodes: int | None
    precision: Precision
    launcher: Launcher
    timeout: datetime.timedelta
    loggers: tuple[Logger, ...]
    written: _Arguments

    @classmethod
    def validate(cls, written: _Arguments) -> _Request:
        return cls(
            accelerator=_check_accelerator(written.accelerator),
            strategy=_check_strategy(written.strategy),
            devices=_check_devices(written.devices),
            num_nodes=None if written.num_nodes is None else _check_positive_int("num_nodes", written.num_nodes),
            precision=precision_for(written.precision),
            launcher=_check_launcher(written.launcher),
            timeout=_check_timeout(written.timeout),
            loggers=check_loggers(written.loggers),
            written=written,
        )


def _choices(values: Sequence[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _check_accelerator(accelerator: object) -> str:
    if not isinstance(accelerator, str) or accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not valid. Valid choices: {_choices(ACCELERATORS)}.")
    return accelerator


def _check_strategy(strategy: object) -> Strategy | str:
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str):
        if strategy == "auto" or strategy in STRATEGIES:
            return strategy
        raise ValueError(
            f"strategy={strategy!r} is not a strategy scopedlite knows. Valid choices: "
            f"{_choices(['auto', *STRATEGIES])}, or an instance such as "
            "lite.DDPStrategy(find_unused_parameters=True)."
        )
    raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__} ({strategy!r}).")


def _check_devices(devices: object) -> str | int | tuple[int, ...]:
    given = devices  # named as the user wrote it (devices='0', not the 0 read from it)
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return "auto"
        try:
            if "," in text:
                devices = [int(p) for p in text.split(",") if p.strip()]
            else:
                devices = int(text)
        except ValueError:
            raise ValueError(
                f"devices={devices!r} is not valid: pass 'auto', a number of devices (2), "
                "or a list of device indices ([0, 1])."
            ) from None
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise TypeError(
            f"devices must be 'auto', an int or a list of ints, got {type(devices).__name__} ({devices!r})."
        )
    if isinstance(devices, int):
        if devices <= 0:
            raise ValueError(f"devices={given!r} is not valid: the number of devices must be at least 1 (or 'auto').")
        return devices
    indices = tuple(devices)
    if not indices:
        raise ValueError(f"devices={given!r} is not valid: name at least one device index, e.g. [0].")
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"devices={given!r} is not valid: indices must be non-negative ints, got {index!r}.")
    if len(set(indices)) != len(indices):
        duplicates = sorted({i for i in indices if indices.count(i) > 1})
        raise ValueError(
            f"devices={given!r} is not valid: index {duplicates} appears more than once; each device runs one process."
        )
    return indices


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < 1:
        raise ValueError(f"{name}={value!r} is not valid: it must be at least 1.")
    return value


def _check_launcher(launcher: object) -> Launcher:
    if not isinstance(launcher, str) or launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is not valid. Valid choices: {_choices(LAUNCHERS)}.")
    return launcher  # type: ignore[return-value]  # one of LAUNCHERS


def _check_timeout(timeout: object) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, datetime.timedelta)):
        raise TypeError(
            f"timeout must be seconds (a number) or a datetime.timedelta, got {type(timeout).__name__} ({timeout!r})."
        )
    delta = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if delta.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} is not valid: it must be a positive duration.")
    return delta


# -- 3. the world this process is a member of already --------------------------------------


def _existing_world(written: _Arguments, env: Mapping[str, str], machine: Machine) -> World | None:
    """A default process group made before launch, else the world a launcher's environment
    describes (torchrun, SLURM, MPI, a worker of ours), else None."""
    world = existing_group_world(env, *machine.process_group) if machine.process_group else detect_world(env)
    if world is not None and world.is_existing_group and written.timeout is not None:
        raise ValueError(
            f"launch(timeout={written.timeout!r}) sets the timeout of a process group launch creates, but "
            "this process joins one made before launch (by Ray Train, a framework or the script), "
            "whose timeout is its maker's. Give it there (init_process_group(timeout=...); Ray: "
            "TorchConfig(timeout_s=...)) and remove timeout= from launch."
        )
    return world


# -- 4. the accelerator, and the precision on it ----------------------------------------------


def _pick_accelerator(requested: str, devices: str | int | tuple[int, ...], machine: Machine) -> str:
    if requested in ("tpu", "xla"):
        if machine.xla_problem is not None:
            raise ImportError(f"accelerator={requested!r}: {machine.xla_problem}")
        if machine.xla_device_count == 0:
            raise ValueError(
                f"accelerator={requested!r} was requested but no XLA device is usable: no TPU "
                "chip is attached and PJRT_DEVICE is not 'CPU' (set PJRT_DEVICE=CPU for one "
                "XLA:CPU device). Use accelerator='cpu' or 'auto'."
            )
        return "xla"
    if requested == "cuda" or (requested == "gpu" and machine.cuda_device_count):
        if machine.cuda_device_count == 0:
            raise ValueError(
                f"accelerator={requested!r} was requested but no CUDA device is visible to "
                "torch (torch.cuda.is_available() is False). Use accelerator='cpu' or 'auto'."
            )
        return "cuda"
    if requested in ("mps", "gpu"):
        if not machine.mps_available:
            raise ValueError(
                f"accelerator={requested!r} was requested but neither CUDA nor MPS is available"
                if requested == "gpu"
                else "accelerator='mps' was requested but torch.backends.mps.is_available() "
                "is False. Use accelerator='cpu' or 'auto'."
            )
        return "mps"
    if requested == "cpu":
        return "cpu"
    # auto
    if machine.cuda_device_count:
        return "cuda"
    if machine.mps_available and devices in ("auto", 1):
        return "mps"
    return "cpu"


def _check_precision(request: _Request, accelerator: str) -> None:
    reason = request.precision.unsupported_reason(accelerator)
    if reason:
        shown = repr(request.precision.name)
        if request.written.precision != request.precision.name:  # a short spelling: say what it means
            shown = f"{request.written.precision!r} (Fabric's short name for {request.precision.name!r})"
        raise ValueError(f"precision={shown} on accelerator={accelerator!r}: {reason}.")


# -- 5. how many processes: on this node, nodes, in all ----------------------------------------


@dataclass(frozen=True)
class _Size:
    """The run's processes: one per device of this node, on ``num_nodes`` nodes."""

    devices: tuple[int, ...]
    num_nodes: int
    world_size: int


def _size(request: _Request, accelerator: str, machine: Machine, world: World | None) -> _Size:
    devices = _device_indices(accelerator, request.devices, machine, world)
    if world is None:
        return _size_of_new_world(devices, request)
    return _size_in_world(devices, request, world)


def _size_of_new_world(devices: tuple[int, ...], request: _Request) -> _Size:
    num_nodes = request.num_nodes or 1
    if num_nodes > 1:
        raise ValueError(
            f"num_nodes={num_nodes}: scopedlite does not start processes on other machines. "
            "Start a multi-node run with torchrun on each node (torchrun --nnodes N "
            "--node-rank R --rdzv-endpoint HOST:PORT script.py); launch then joins the "
            "world it creates."
        )
    return _Size(devices, num_nodes, len(devices) * num_nodes)


def _size_in_world(devices: tuple[int, ...], request: _Request, world: World) -> _Size:
    """The size of ``world``, which the arguments may restate but never change."""
    if request.launcher != "auto" and not world.is_ours:
        raise ValueError(
            f"launcher={request.launcher!r} cannot be used inside an existing world (made by {world.source}): "
            "the processes exist already and launch joins them. Use launcher='auto'."
        )
    # SLURM may place different numbers of tasks on different nodes and says how many
    # nodes there are; elsewhere the world is uniform.
    world_nodes = world.num_nodes or max(1, world.world_size // world.local_world_size)
    num_nodes = request.num_nodes or world_nodes
    uniform = world.num_nodes == 0 or world.local_world_size * world.num_nodes == world.world_size
    if (
        len(devices) != world.local_world_size
        or num_nodes != world_nodes
        or (uniform and len(devices) * num_nodes != world.world_size)
    ):
        raise ValueError(
            f"launch(devices={request.written.devices!r}, num_nodes={request.written.num_nodes!r}) asks for "
            f"{len(devices)} process(es) per node on {num_nodes} node(s), but the {world.source} "
            f"world has {world.local_world_size} per node and {world.world_size} in all. "
            "Make them agree, or pass devices='auto' and leave num_nodes unset."
        )
    return _Size(devices, num_nodes, world.world_size)


def _device_indices(
    accelerator: str, devices: str | int | tuple[int, ...], machine: Machine, world: World | None
) -> tuple[int, ...]:
    if accelerator == "cpu":
        if isinstance(devices, tuple):
            raise ValueError(
                f"devices={list(devices)!r}: a list of device indices applies to CUDA; on "
                f"accelerator='cpu' pass a number of processes, e.g. devices={len(devices)}."
            )
        count = (world.local_world_size if world else 1) if devices == "auto" else devices
        return tuple(range(count))  # type: ignore[arg-type]
    if accelerator == "xla":
        return _xla_devices(devices, machine, world)
    if accelerator == "mps":
        if devices not in ("auto", 1, (0,)):
            raise ValueError(f"devices={devices!r} is not valid on accelerator='mps': there is one MPS device.")
        return (0,)
    available = machine.cuda_device_count
    if devices == "auto":
        count = world.local_world_size if world else available
        return tuple(range(count))
    if isinstance(devices, int):
        if devices > available:
            raise ValueError(
                f"devices={devices} but only {available} CUDA device(s) are visible. Use devices={available} or fewer."
            )
        return tuple(range(devices))
    too_high = [i for i in devices if i >= available]  # type: ignore[union-attr]
    if too_high:
        raise ValueError(
            f"devices={list(devices)!r} names CUDA index {too_high} but only {available} "  # type: ignore[arg-type]
            f"device(s) are visible (valid indices 0..{available - 1})."
        )
    return devices  # type: ignore[return-value]


def _xla_devices(devices: str | int | tuple[int, ...], machine: Machine, world: World | None) -> tuple[int, ...]:
    """One entry per process. Each XLA process is bound to one chip, which it sees as
    ``xla:0``, so every entry is 0."""
    available = machine.xla_device_count
    if isinstance(devices, tuple):
        raise ValueError(
            f"devices={list(devices)!r}: on accelerator='tpu' pass a number of devices "
            f"(one process per chip), e.g. devices={len(devices)}, or 'auto'."
        )
    count = (world.local_world_size if world else available) if devices == "auto" else devices
    if world is None and 1 < count < available:
        raise ValueError(
            f"devices={devices!r}: torch_xla runs one process on every TPU chip of the host "
            f"({available}) or one process alone. Use devices='auto' or devices=1."
        )
    if count > available:
        raise ValueError(
            f"devices={devices!r} but only {available} XLA device(s) are usable here"
            + (" (XLA:CPU runs one device: devices=1)." if available == 1 else f". Use devices={available} or fewer.")
        )
    return (0,) * count


# -- 6. the strategy ---------------------------------------------------------------------------


def _strategy_for(request: _Request, accelerator: str, size: _Size, world: World | None) -> Strategy:
    """The strategy asked for (an instance, a name, or ``"auto"``: DDP, or XLA's, for several
    processes), checked against the accelerator, the size and the precision."""
    if isinstance(request.strategy, Strategy):
        strategy = request.strategy
    else:
        several = size.world_size > 1 or world is not None
        auto = ("xla" if several else "xla_single") if accelerator == "xla" else ("ddp" if several else "single")
        strategy = STRATEGIES[auto if request.strategy == "auto" else request.strategy]()
    if not strategy.multi_process and size.world_size > 1:
        raise ValueError(
            f"strategy={strategy.name!r} runs one process, but the run has "
            f"{size.world_size} (devices={request.written.devices!r}, num_nodes={size.num_nodes}). "
            "Use strategy='ddp', or devices=1."
        )
    if accelerator not in strategy.accelerators:
        raise ValueError(
            f"strategy={strategy.name!r} does not run on accelerator={accelerator!r}; it "
            f"supports {_choices(strategy.accelerators)}."
        )
    strategy.check(accelerator, size.world_size, request.precision.name)
    return strategy


# -- 7. the launcher ---------------------------------------------------------------------------


def _launcher_for(request: _Request, strategy: Strategy, world: World | None, machine: Machine) -> LauncherMode:
    if world is not None:
        return "join"
    if not strategy.multi_process:
        if request.launcher != "auto":
            raise ValueError(
                f"launcher={request.launcher!r} starts processes, but strategy="
                f"{strategy.name!r} runs in this one. Use launcher='auto'."
            )
        return "none"
    return _start_method(request.launcher, strategy, machine)


def _start_method(requested: Launcher, strategy: Strategy, machine: Machine) -> LauncherMode:
    """How our launcher starts the other local processes: the one asked for, else the
    strategy's, else re-executing the script where there is one to re-execute."""
    if requested == "auto":
        requested = strategy.launcher or "auto"  # type: ignore[assignment]  # "script", "fork" or None
    if requested == "auto":
        requested = "script" if machine.has_script and not machine.launched_before else "fork"
    if requested == "script":
        if not machine.has_script:
            raise ValueError(
                "launcher='script' re-executes the command line, but this process has none "
                "to re-execute (a notebook, a REPL, stdin, or pytest). Use launcher='fork' "
                "or 'auto'."
            )
        if machine.script_problem:
            raise ValueError(
                f"launch cannot start its workers by re-executing the command line: {machine.script_problem}"
            )
        if machine.launched_before:
            raise ValueError(
                "launcher='script' cannot start a second multi-process launch block in one "
                "script: its re-executed workers would run the first block again. Use "
                "launcher='auto' (which forks for later blocks) or put each block in its own "
                "script."
            )
    if requested == "fork":
        if not hasattr(os, "fork"):
            raise ValueError("launcher='fork' needs os.fork, which this platform lacks; run a script instead.")
        if machine.cuda_initialized:
            if machine.launched_before:
                raise ValueError(
                    "Cannot start this launch block: an earlier multi-process block of this "
                    "script used CUDA, so forking is unsafe, and re-executing the script would "
                    "run the earlier block again. Put each multi-GPU launch block in its own "
                    "script."
                )
            raise ValueError(
                "Cannot fork worker processes: CUDA is already initialised in this process, "
                "and a forked child cannot use it. Move the code that touches CUDA inside the "
                "`with lite.launch(...)` block (or restart the kernel and launch first)"
                + (", or run this as a script." if not machine.has_script else ".")
            )
    return requested
