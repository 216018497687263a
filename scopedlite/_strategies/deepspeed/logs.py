"""Keeping DeepSpeed's logging, prints and warnings out of the user's output.

Errors still raise and warnings of its own that matter still show; what is hidden is the
noise it makes on every rank and every step.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

__all__ = ["Discard", "filtered_warnings", "quiet_deepspeed"]


class Discard:
    """A stdout that drops DeepSpeed's unconditional prints (e.g. "op built successfully")."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        return None


def quiet_deepspeed() -> int:
    """Keep DeepSpeed's INFO logging (config dumps, timers, per-step reports) out of the way;
    warnings and errors still show. Returns the level it had."""
    from deepspeed.utils import logger

    previous = logger.level
    logger.setLevel(max(previous, logging.WARNING))
    return previous


@contextlib.contextmanager
def filtered_warnings() -> Any:
    """Hide torch deprecation warnings ZeRO-3 triggers on every step (its use of
    ``torch.distributed._all_gather_base``-era APIs and tensor storage); they are DeepSpeed's
    to fix and say nothing to the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"deepspeed\..*")
        yield
