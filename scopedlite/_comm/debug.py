"""Desync detection: with ``SCOPEDLITE_DEBUG=1``, every collective of ours first checks that
all ranks are calling the same one.

A rank that calls a different collective, or the same one with another shape or dtype, makes
gloo abort the process (SIGABRT) or makes the ranks wait until the timeout. In debug mode each
collective is preceded by an exchange of short descriptions (operation, shape, dtype, and the
user's file:line); on a mismatch every rank raises :class:`CollectiveMismatchError` listing what
each rank called and where. It costs two small extra collectives per call, so it is off by
default.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import zlib
from typing import Any

import torch

from scopedlite._comm.wire import gather_objects
from scopedlite._core.process import this_process

__all__ = [
    "PACKAGE_DIR",
    "CollectiveMismatchError",
    "call_site",
    "calling_line",
    "check_same_collective",
    "debug_enabled",
    "is_users_own",
    "order_check_enabled",
    "site_id",
    "site_name",
]

# The scopedlite package folder (this file is in scopedlite/_comm/), with its separator: a
# frame whose file starts with it is ours.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class CollectiveMismatchError(RuntimeError):
    """The ranks called different collectives (or shapes/dtypes) at the same point."""


def debug_enabled() -> bool:
    return os.environ.get("SCOPEDLITE_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def order_check_enabled() -> bool:
    """Whether a collective of ours checks first, through the gather ledger, that no other rank
    went on past it (``_api/collectives.py``); ``SCOPEDLITE_ORDER_CHECK=0`` turns it off."""
    return os.environ.get("SCOPEDLITE_ORDER_CHECK", "").strip().lower() not in ("0", "false", "no", "off")


def call_site() -> str:
    """Where the user called into scopedlite: the first frame outside it (``file:line``) and,
    after ``from``, the user lines that called that one, innermost first (``/x/train.py:12
    (from train.py:40, train.py:51)``). The callers are the frames of the user's own files
    (:func:`_user_file`) directly around it: they tell a helper called on some ranks only
    (``if rank == 0: reduce_mean(acc)``) from the others' next call of it (``reduce_mean(loss)``
    on every rank), which runs the same line."""
    frame = sys._getframe(1)
    while frame is not None and _is_ours(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    callers = []
    caller = frame.f_back
    while caller is not None and len(callers) < _MAX_CALLERS:
        name = _user_file(caller.f_code.co_filename)
        if name is None:
            break
        callers.append(f"{name}:{caller.f_lineno}")
        caller = caller.f_back
    return f"{site}{_FROM}{', '.join(callers)})" if callers else site


_FROM = " (from "  # between a call site's line and its callers


def calling_line(name: str) -> str:
    """The line of a call site as :func:`call_site` names it, without its callers."""
    return name.partition(_FROM)[0]


_MAX_CALLERS = 32  # a deeper recursion is compared by its innermost callers
_OURS: dict[str, bool] = {}  # co_filename -> whether the file is scopedlite's
_USER: dict[str, str | None] = {}  # co_filename -> its base name where it is the user's own, else None


def _is_ours(filename: str) -> bool:
    ours = _OURS.get(filename)
    if ours is None:
        ours = _OURS[filename] = os.path.abspath(filename).startswith(PACKAGE_DIR)
    return ours


def is_users_own(filename: str) -> bool:
    """Whether ``filename`` is one of the user's own files (a script, a module beside it):
    not scopedlite's, torch's, the standard library's or anything installed."""
    return _user_file(filename) is not None


def _user_file(filename: str) -> str | None:
    """The base name of ``filename`` where it is a file of the user's own (a script, a module
    beside it), else None: scopedlite, torch, the standard library and anything installed
    (runpy, a launcher, pytest, Ray's worker, IPython) sit above the user's frames
    differently on different ranks (the launching rank runs the script itself, the others
    are started through runpy), so they end the callers."""
    if filename not in _USER:
        path = os.path.abspath(filename)
        mine = not filename.startswith("<") and not path.startswith(_library_dirs())
        _USER[filename] = os.path.basename(path) if mine else None
    return _USER[filename]


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """The folders of what is not the user's code: scopedlite, torch, the standard library
    and every site-packages folder (a virtual environment's and its base Python's)."""
    folders = {PACKAGE_DIR, os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))}
    for scheme in (
        sysconfig.get_paths(),
        sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix}),
    ):
        folders.update(scheme[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in scheme)
    folders.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    folders.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.abspath(f), "") for f in folders if f)


def site_id(name: str) -> int:
    """A stable integer for a call site as :func:`call_site` names it, the same on every rank
    wherever each node keeps the script: the file's folder is left out (one node runs
    ``python train.py``, another ``python /home/x/train.py``, and they call from the same
    line). The process keeps the name, to show it (:func:`site_name`)."""
    line, bracket, callers = name.partition(_FROM)
    path, _, number = line.rpartition(":")
    value = zlib.crc32(f"{os.path.basename(path)}:{number}{bracket}{callers}".encode()) & 0x7FFFFFFF
    this_process.site_names.setdefault(value, name)
    return value


def site_name(value: int) -> str:
    """The name of a call site by its :func:`site_id`, as this process saw it."""
    return this_process.site_names.get(value, f"site #{value}")


def describe(
    kind: str,
    tensor: torch.Tensor | None = None,
    op: str | None = None,
    src: int | None = None,
    rows_differ: bool = False,
) -> str:
    """What a rank calls, as the ranks compare it; ``rows_differ``: the first dimension may
    differ between ranks (``gather_for_metrics``), so it is left out."""
    parts = []
    if op is not None:
        parts.append(f"op={op!r}")
    if src is not None:
        parts.append(f"src={src}")
    if tensor is not None:
        shape = ("*", *tensor.shape[1:]) if rows_differ else tuple(tensor.shape)
        parts.append(f"shape=({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''}), dtype={tensor.dtype}")
    return f"{kind}({', '.join(parts)})"


def check_same_collective(target: Any, rank: int, device: torch.device, what: str) -> None:
    """Raise on every rank if the ranks' descriptions ``what`` differ.

    ``target`` is the strategy or join session whose ``all_gather`` carries the exchange
    (inside ``lite.join`` only the active ranks take part, which is what must agree).
    """
    entries = gather_objects((what, call_site()), target.all_gather, device)
    if len({e[0] for e in entries}) > 1:
        table = "\n".join(f"  rank {r}: {e[0]} at {e[1]}" for r, e in enumerate(entries))
        raise CollectiveMismatchError(
            "The ranks called different collectives at the same point (caught by "
            f"SCOPEDLITE_DEBUG=1 before torch.distributed could abort):\n{table}\n"
            "Every rank must call the same collectives, with the same shapes and dtypes, "
            "in the same order."
        )
