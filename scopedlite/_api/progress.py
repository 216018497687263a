"""``lite.progress``: a progress bar drawn by rank 0 only, with no dependency.

Every rank iterates; only global rank 0 draws, so N ranks make one bar, not N fighting
over the terminal. On a terminal the bar redraws in place (at most ten times a second);
anywhere else (a log file, CI, a pipe) it prints a plain line at each tenth of the way,
so logs stay readable instead of filling with carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TextIO, TypeVar

from scopedlite._api.current import current

__all__ = ["progress"]

T = TypeVar("T")

_WIDTH = 24
_REDRAW_SECONDS = 0.1


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"


def format_progress(desc: str, count: int, total: int | None, elapsed: float, bar: bool) -> str:
    """One progress line: ``desc: 40% |#########           | 4/10 [00:02<00:03, 2.0 it/s]``."""
    rate = count / elapsed if elapsed > 0 else 0.0
    head = f"{desc}: " if desc else ""
    if total:
        fraction = min(1.0, count / total)
        left = (total - count) / rate if rate > 0 else 0.0
        drawn = f"|{'#' * int(fraction * _WIDTH):<{_WIDTH}}| " if bar else ""
        return f"{head}{fraction:4.0%} {drawn}{count}/{total} [{_duration(elapsed)}<{_duration(left)}, {rate:.1f} it/s]"
    return f"{head}{count} [{_duration(elapsed)}, {rate:.1f} it/s]"


def progress(
    iterable: Iterable[T],
    desc: str = "",
    total: int | None = None,
    file: TextIO | None = None,
) -> Iterator[T]:
    """Iterate over ``iterable``; global rank 0 shows how far along it is.

    Args:
        iterable: What to iterate over (a loader, a range, ...).
        desc: A label shown before the bar.
        total: Number of items; by default ``len(iterable)`` when it has one.
        file: Where to draw (default ``sys.stderr``, as tqdm does, so stdout stays data).

    Returns:
        An iterator over the items of ``iterable``, unchanged, on every rank.

    Raises:
        ValueError: ``total`` is not a non-negative int or None (at the call, not later).
    """
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise ValueError(f"total={total!r} is not valid: pass the number of items (an int >= 0) or None.")
    if not current().is_global_zero:
        return iter(iterable)
    return _drawn(iterable, desc, total, file if file is not None else sys.stderr)


def _drawn(iterable: Iterable[T], desc: str, total: int | None, out: TextIO) -> Iterator[T]:
    is_tty = bool(getattr(out, "isatty", lambda: False)())
    start = last_draw = time.monotonic()
    count, shown_tenth = 0, 0

    def draw(final: bool = False) -> None:
        line = format_progress(desc, count, total, time.monotonic() - start, bar=is_tty)
        out.write(f"\r{line}" + ("\n" if final else "") if is_tty else f"{line}\n")
        out.flush()

    if is_tty:
        draw()
    for item in iterable:
        yield item
        count += 1
        if is_tty:
            now = time.monotonic()
            if now - last_draw >= _REDRAW_SECONDS:
                last_draw = now
                draw()
        elif total:
            tenth = count * 10 // total
            if tenth > shown_tenth and count < total:
                shown_tenth = tenth
                draw()
    if is_tty or total != 0:
        draw(final=True)
