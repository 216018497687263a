"""Turning the arguments of ``launch`` into a frozen plan, before anything starts.

:func:`resolve` is the one place where arguments meet the environment. It is pure: it reads
the arguments, a mapping of environment variables and a :class:`Machine` description, and
returns a :class:`Plan` or raises. Every argument is validated on its own first, then the
combinations; nothing the user asked for is silently replaced by something else.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from scopedlite._cluster.environments import EXISTING_GROUP, World, detect_world, existing_group_world
from scopedlite._core.precision import Precision, precision_for
from scopedlite._hardware.machine import Machine
from scopedlite._loggers.base import Logger, check_loggers
from scopedlite._strategies.base import Strategy
from scopedlite._strategies.registry import STRATEGIES

__all__ = ["ACCELERATORS", "COMMAND_LINE", "LAUNCHERS", "Plan", "resolve"]

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu", "xla")
LAUNCHERS = ("auto", "script", "fork")
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
# What ``launch`` takes when the script leaves an argument out.
_DEFAULTS = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": None, "precision": "32-true"}


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
    """

    accelerator: str
    strategy: Strategy = field(compare=False)
    precision: Precision
    devices: tuple[int, ...]
    num_nodes: int
    world_size: int
    launcher: str
    timeout: datetime.timedelta
    world: World | None = None
    loggers: tuple[Logger, ...] = field(default=(), compare=False)

    @property
    def local_world_size(self) -> int:
        return len(self.devices)


def _choices(values: Sequence[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _check_accelerator(accelerator: object) -> str:
    if not isinstance(accelerator, str) or accelerator not in ACCELERATORS:
        raise ValueError(
            f"accelerator={accelerator!r} is not valid. Valid choices: {_choices(ACCELERATORS)}."
        )
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
    raise TypeError(
        f"strategy must be a name or a Strategy instance, got {type(strategy).__name__} "
        f"({strategy!r})."
    )


def _check_devices(devices: object) -> str | int | tuple[int, ...]:
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
            f"devices must be 'auto', an int or a list of ints, got {type(devices).__name__} "
            f"({devices!r})."
        )
    if isinstance(devices, int):
        if devices <= 0:
            raise ValueError(
                f"devices={devices!r} is not valid: the number of devices must be at least 1 "
                "(or 'auto')."
            )
        return devices
    indices = tuple(devices)
    if not indices:
        raise ValueError("devices=[] is not valid: name at least one device index, e.g. [0].")
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(
                f"devices={list(indices)!r} is not valid: indices must be non-negative ints, "
                f"got {index!r}."
            )
    if len(set(indices)) != len(indices):
        duplicates = sorted({i for i in indices if indices.count(i) > 1})
        raise ValueError(
            f"devices={list(indices)!r} is not valid: index {duplicates} appears more than "
            "once; each device runs one process."
        )
    return indices


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < 1:
        raise ValueError(f"{name}={value!r} is not valid: it must be at least 1.")
    return value


def _check_launcher(launcher: object) -> str:
    if not isinstance(launcher, str) or launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is not valid. Valid choices: {_choices(LAUNCHERS)}.")
    return launcher


def _check_timeout(timeout: object) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, datetime.timedelta)):
        raise TypeError(
            f"timeout must be seconds (a number) or a datetime.timedelta, got "
            f"{type(timeout).__name__} ({timeout!r})."
        )
    delta = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if delta.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} is not valid: it must be a positive duration.")
    return delta


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


def _device_indices(accelerator: str, devices: str | int | tuple[int, ...], machine: Machine, world: World | None) -> tuple[int, ...]:
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
                f"devices={devices} but only {available} CUDA device(s) are visible. Use "
                f"devices={available} or fewer."
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
    accelerator, strategy, devices, num_nodes, precision = _command_line(
        {"accelerator": accelerator, "strategy": strategy, "devices": devices, "num_nodes": num_nodes, "precision": precision},
        env,
    )
    requested_accelerator = _check_accelerator(accelerator)
    chosen_strategy = _check_strategy(strategy)
    requested_devices = _check_devices(devices)
    requested_nodes = None if num_nodes is None else _check_positive_int("num_nodes", num_nodes)
    chosen_precision = precision_for(precision)
    requested_launcher = _check_launcher(launcher)
    chosen_timeout = _check_timeout(timeout)
    chosen_loggers = check_loggers(loggers)

    world = existing_group_world(env, *machine.process_group) if machine.process_group else detect_world(env)
    if world is not None and world.source == EXISTING_GROUP and timeout is not None:
        raise ValueError(
            f"launch(timeout={timeout!r}) sets the timeout of a process group launch creates, but "
            "this process joins one made before launch (by Ray Train, a framework or the script), "
            "whose timeout is its maker's. Give it there (init_process_group(timeout=...); Ray: "
            "TorchConfig(timeout_s=...)) and remove timeout= from launch."
        )
    accel = _pick_accelerator(requested_accelerator, requested_devices, machine)
    reason = chosen_precision.unsupported_reason(accel)
    if reason:
        shown = repr(chosen_precision.name)
        if precision != chosen_precision.name:  # a short spelling: say what it means
            shown = f"{precision!r} (Fabric's short name for {chosen_precision.name!r})"
        raise ValueError(f"precision={shown} on accelerator={accel!r}: {reason}.")
    indices = _device_indices(accel, requested_devices, machine, world)

    if world is not None:
        # SLURM may place different numbers of tasks on different nodes and says how many
        # nodes there are; elsewhere the world is uniform.
        world_nodes = world.num_nodes or max(1, world.world_size // world.local_world_size)
        nodes = requested_nodes or world_nodes
        if requested_launcher != "auto" and world.source != "scopedlite":
            raise ValueError(
                f"launcher={requested_launcher!r} cannot be used inside an existing world (made by {world.source}): "
                "the processes exist already and launch joins them. Use launcher='auto'."
            )
        uniform = world.num_nodes == 0 or world.local_world_size * world.num_nodes == world.world_size
        if len(indices) != world.local_world_size or nodes != world_nodes or (uniform and len(indices) * nodes != world.world_size):
            raise ValueError(
                f"launch(devices={devices!r}, num_nodes={num_nodes!r}) asks for "
                f"{len(indices)} process(es) per node on {nodes} node(s), but the {world.source} "
                f"world has {world.local_world_size} per node and {world.world_size} in all. "
                "Make them agree, or pass devices='auto' and leave num_nodes unset."
            )
        world_size = world.world_size
    else:
        nodes = requested_nodes or 1
        world_size = len(indices) * nodes
        if nodes > 1:
            raise ValueError(
                f"num_nodes={nodes}: scopedlite does not start processes on other machines. "
                "Start a multi-node run with torchrun on each node (torchrun --nnodes N "
                "--node-rank R --rdzv-endpoint HOST:PORT script.py); launch then joins the "
                "world it creates."
            )

    if chosen_strategy == "auto":
        name = "ddp" if world_size > 1 or world is not None else "single"
        if accel == "xla":
            name = "xla" if world_size > 1 or world is not None else "xla_single"
        chosen_strategy = STRATEGIES[name]()
    elif isinstance(chosen_strategy, str):
        chosen_strategy = STRATEGIES[chosen_strategy]()
    if not chosen_strategy.multi_process and world_size > 1:
        raise ValueError(
            f"strategy={chosen_strategy.name!r} runs one process, but the run has "
            f"{world_size} (devices={devices!r}, num_nodes={nodes}). Use strategy='ddp', or "
            "devices=1."
        )
    if accel not in chosen_strategy.accelerators:
        raise ValueError(
            f"strategy={chosen_strategy.name!r} does not run on accelerator={accel!r}; it "
            f"supports {_choices(chosen_strategy.accelerators)}."
        )
    chosen_strategy.check(accel, world_size, chosen_precision.name)

    if world is not None:
        mode = "join"
    elif not chosen_strategy.multi_process:
        mode = "none"
        if requested_launcher != "auto":
            raise ValueError(
                f"launcher={requested_launcher!r} starts processes, but strategy="
                f"{chosen_strategy.name!r} runs in this one. Use launcher='auto'."
            )
    else:
        mode = _pick_launcher(requested_launcher, chosen_strategy, world_size, machine)

    return Plan(
        accelerator=accel,
        strategy=chosen_strategy,
        precision=chosen_precision,
        devices=indices,
        num_nodes=nodes,
        world_size=world_size,
        launcher=mode,
        timeout=chosen_timeout,
        world=world,
        loggers=chosen_loggers,
    )


def _command_line(arguments: dict[str, Any], env: Mapping[str, str]) -> tuple[Any, ...]:
    """Merge the script's ``launch`` arguments with the options of ``python -m scopedlite run``.

    The rule: an argument equal to its default (written out or not) takes the command line's
    value, so a bare ``lite.launch()`` is configured from the command line the way a bare
    ``Fabric()`` is by ``fabric run``. An argument set to anything else must agree with the
    command line: a strategy instance agrees with the name of its class (the script's
    instance, with its options, is used), a list of device indices with a count of the same
    length. Anything else is a contradiction, and silently preferring either side would run
    something one of them did not ask for.
    """
    merged = dict(arguments)
    for name, variable in COMMAND_LINE.items():
        text = env.get(variable)
        if text is None:
            continue
        flag = "--" + name.replace("_", "-")
        try:
            given = _parse_command_line(name, text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{variable}={text!r} (python -m scopedlite run {flag}) is not valid: {e}") from e
        value = arguments[name]
        if _is_default(name, value):
            merged[name] = given
        elif not _agrees(name, value, given):
            raise ValueError(
                f"launch({name}={value!r}) in the script contradicts `python -m scopedlite run "
                f"{flag} {text}`. Remove {name}= from the launch call to take the command "
                f"line's value, or make the two agree."
            )
    return tuple(merged[name] for name in ("accelerator", "strategy", "devices", "num_nodes", "precision"))


def _is_default(name: str, value: Any) -> bool:
    if name == "precision":
        return _precision_name(value) == _DEFAULTS[name]  # 32 and "32" are "32-true" written short
    return isinstance(value, (str, type(None))) and value == _DEFAULTS[name]


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
            kinds = [entry.cls for entry in STRATEGIES.values() if isinstance(value, entry.cls)]
            own = max(kinds, key=lambda cls: len(cls.__mro__), default=None)
            return given != "auto" and own is STRATEGIES[given].cls
        return value == given or (value in STRATEGIES and given in STRATEGIES and STRATEGIES[value] == STRATEGIES[given])
    if name == "devices":
        if isinstance(value, (list, tuple)) and isinstance(given, int):
            return len(value) == given
        if isinstance(value, str) and value.strip().isdigit():
            return int(value) == given
    if name == "precision":
        return bool(_precision_name(value) == given)
    return bool(value == given)


def _pick_launcher(requested: str, strategy: Strategy, world_size: int, machine: Machine) -> str:
    if requested == "auto":
        requested = strategy.launcher or "auto"
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
            raise ValueError(f"launch cannot start its workers by re-executing the command line: {machine.script_problem}")
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
