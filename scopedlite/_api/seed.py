"""``lite.seed_everything``: one seed for Python, numpy (if installed) and torch."""

from __future__ import annotations

import contextvars
import random

import torch

__all__ = ["current_seed", "seed_everything"]

_seed: contextvars.ContextVar[int] = contextvars.ContextVar("scopedlite.seed", default=0)
_MAX = 2**32 - 1


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, numpy and torch (all devices) with ``seed``.

    The seed is also what the distributed sampler of ``setup_dataloader`` shuffles with, so
    shuffling is reproducible and identical on every rank. Re-executed workers run the same
    call; forked workers inherit it.

    Returns:
        The seed.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX:
        raise ValueError(f"seed={seed!r} is not valid: it must be an int in 0..{_MAX}.")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every device as well
    _seed.set(seed)
    return seed


def current_seed() -> int:
    """The seed given to the last ``seed_everything`` in this context (0 if never called)."""
    return _seed.get()
