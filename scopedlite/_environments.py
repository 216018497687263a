"""Cluster environments: worlds that already exist when ``launch`` is called.

When a process was started by torchrun, or is a worker that our own launcher re-executed,
the world is already there: ``launch`` spawns nothing and joins it. Each environment is one
small detector that reads a mapping of environment variables and returns a :class:`World`
or None. Detection is pure (it reads the mapping it is given, never ``os.environ``), so the
resolver stays a pure function and tests pass plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["ENV", "World", "detect_world"]


class ENV:
    """Names of the variables our launcher hands to the workers it starts."""

    TOKEN = "SCOPEDLITE_LAUNCH_TOKEN"  # identifies the launch that started this worker
    SITE = "SCOPEDLITE_LAUNCH_SITE"  # file:line of that launch, checked by the worker
    ERROR_FILE = "SCOPEDLITE_ERROR_FILE"  # where a failing worker writes its traceback
    PARENT_PID = "SCOPEDLITE_PARENT_PID"


@dataclass(frozen=True)
class World:
    """An existing world this process is a member of.

    Attributes:
        source: Who made it: ``"scopedlite"`` (a worker of ours) or ``"torchelastic"``.
        global_rank, local_rank, node_rank, world_size, local_world_size: As in torchrun.
        main_address, main_port: Where rank 0's rendezvous store listens.
    """

    source: str
    global_rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    main_address: str
    main_port: int


def _int(env: Mapping[str, str], name: str, source: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(
            f"The {source} environment is incomplete: the variable {name} is not set. "
            f"Variables present: {sorted(k for k in env if k.isupper())[:40]}."
        )
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"The {source} environment has {name}={raw!r}, not an integer.") from e


def _standard_world(env: Mapping[str, str], source: str) -> World:
    world_size = _int(env, "WORLD_SIZE", source)
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    return World(
        source=source,
        global_rank=_int(env, "RANK", source),
        local_rank=_int(env, "LOCAL_RANK", source),
        node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
        world_size=world_size,
        local_world_size=local_world_size,
        main_address=env.get("MASTER_ADDR", "127.0.0.1"),
        main_port=_int(env, "MASTER_PORT", source),
    )


def _ours(env: Mapping[str, str]) -> World | None:
    if ENV.TOKEN not in env:
        return None
    return _standard_world(env, "scopedlite")


def _torchelastic(env: Mapping[str, str]) -> World | None:
    # torchrun always sets TORCHELASTIC_RUN_ID; RANK alone could be anything.
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    return _standard_world(env, "torchelastic")


# Checked in order; the first that recognises the environment wins. Our own marker comes
# first: a worker of ours started under torchrun is ours.
DETECTORS: tuple[Callable[[Mapping[str, str]], World | None], ...] = (_ours, _torchelastic)


def detect_world(env: Mapping[str, str]) -> World | None:
    """Return the world this environment describes, or None outside any."""
    for detect in DETECTORS:
        world = detect(env)
        if world is not None:
            return world
    return None
