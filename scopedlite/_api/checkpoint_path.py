"""One checkpoint path on every rank, checked before ``lite.save`` writes or ``lite.load`` reads.

A path computed on each rank (``tempfile.mkdtemp()``, a timestamp at the top of the script:
every re-executed rank computes its own) names a different place on each: under a sharding
strategy each rank would write its shard to its own folder and ``save`` would return as if
all went well, and ``load`` would read another checkpoint on each rank. So every rank
compares its path with the others' first, in one all-reduce of two integers (a digest of
the path, and its negation, reduced by max: they agree when the largest digest is also the
smallest), and on a difference every rank raises, naming each rank's path.

Paths are compared as strings, absolute and normalized (``os.path.abspath``): that is what
every rank can check without touching the storage. Two nodes that mount the same storage at
different points write the same checkpoint under different names, and are refused.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from scopedlite._api.current import current
from scopedlite._api.every_rank import every_rank_calls
from scopedlite._api.join import active_session
from scopedlite._comm.wire import gather_objects

__all__ = ["check_same_path"]

_LISTED = 8  # distinct paths named in the error; the rest are counted


def check_same_path(path: str | os.PathLike[str], caller: str) -> None:
    """Refuse, on every rank at once, a ``path`` that is not the same on every rank.

    A collective (every rank calls ``lite.save`` and ``lite.load``); nothing on one process.
    A call on some ranks only is refused first, on the ranks that make it (``every_rank.py``).

    Args:
        path: What this rank passed.
        caller: ``"lite.save"`` or ``"lite.load"``, for the message.
    """
    run = current()
    if run.world_size == 1:
        return
    mine = os.path.abspath(os.fsdecode(path))
    aside = " (lite.save itself has rank 0 alone write what is one file)" if caller == "lite.save" else ""
    every_rank_calls(
        caller,
        "the ranks check that they name the same path, and where each holds part of the model it "
        "writes or reads that part",
        f"Call {caller} on every rank, not under `if run.is_global_zero:`{aside}.",
    )
    session = active_session(run)
    target: Any = session if session is not None else run.strategy
    # 62 bits, so that the negation of every digest is an int64 too
    digest = int.from_bytes(hashlib.blake2b(mine.encode(), digest_size=8).digest(), "little") >> 2
    largest, negated_smallest = target.all_reduce(torch.tensor([digest, -digest], device=run.device), "max").tolist()
    if largest == -negated_smallest:
        return
    paths = _every_rank(target, run.global_rank, mine, run.device)
    raise ValueError(_message(caller, paths))


def _every_rank(target: Any, rank: int, path: str, device: torch.device) -> dict[int, str]:
    """Each rank's path (only after the digests differed: the ranks all know to call this).
    Inside ``lite.join`` the session gathers from the ranks still running: each names itself."""
    return dict(gather_objects((rank, path), target.all_gather, device))


def _message(caller: str, paths: dict[int, str]) -> str:
    ranks: dict[str, list[int]] = {}
    for rank in sorted(paths):
        ranks.setdefault(paths[rank], []).append(rank)
    listed = [
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {p!r}" for p, r in list(ranks.items())[:_LISTED]
    ]
    if len(ranks) > _LISTED:
        listed.append(f"and {len(ranks) - _LISTED} other paths")
    does = (
        "each writes its part there, or waits for rank 0's file"
        if caller == "lite.save"
        else "each reads its part there"
    )
    return (
        f"{caller}: the path differs between ranks ({'; '.join(listed)}). Every rank must pass the same "
        f"path ({does}). A path computed on each rank (tempfile.mkdtemp(), a timestamp, a random "
        "name) differs between them: compute it once and share it, `path = lite.broadcast(path)`, or "
        "derive it from something every rank shares (the command line, a config). Paths are compared "
        "as absolute paths (os.path.abspath): where nodes mount the same storage at different points, "
        "write the path the same way on every rank."
    )
