"""``lite.seed_everything``: one seed for Python, numpy and torch.

Also the two places where scopedlite itself seeds those generators: while a sampler draws its
order (so every rank draws the same one) and in each DataLoader worker (so workers differ per
rank as well as per worker).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

__all__ = [
    "SeedWorker",
    "Seeding",
    "current_seed",
    "current_seeding",
    "seed_everything",
    "seed_worker",
    "seeded_generators",
]

_MAX = 2**32 - 1


@dataclass(frozen=True, eq=False)
class Seeding:
    """One call of ``seed_everything`` (or none yet), told apart from every other call even
    with the same seed: what a loader's epoch count starts afresh from (see ``epochs``)."""

    seed: int


_UNSEEDED = Seeding(0)
_seeding: contextvars.ContextVar[Seeding] = contextvars.ContextVar("scopedlite.seed", default=_UNSEEDED)


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, numpy and torch (all devices) with ``seed``.

    The seed is also what the distributed sampler of ``setup_dataloader`` shuffles with, so
    shuffling is reproducible; ``setup_dataloader`` takes rank 0's, so it is identical on
    every rank even if ranks seed differently. Re-executed workers run the same
    call; forked workers inherit it. A loader set up after this call starts at epoch 0 even
    when it is rebuilt over the dataset of an earlier one, so the same seed gives the same
    order again.

    Returns:
        The seed.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX:
        raise ValueError(f"seed={seed!r} is not valid: it must be an int in 0..{_MAX}.")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every device as well
    _seeding.set(Seeding(seed))
    return seed


def current_seed() -> int:
    """The seed given to the last ``seed_everything`` in this context (0 if never called)."""
    return _seeding.get().seed


def current_seeding() -> Seeding:
    """The last ``seed_everything`` call in this context, as an object of its own."""
    return _seeding.get()


@contextlib.contextmanager
def seeded_generators(seed: int) -> Iterator[None]:
    """Seed torch's, Python's and numpy's global generators with ``seed`` for the block only.

    A user's sampler may shuffle with any of the three; seeding all of them from one seed that
    every rank agrees on makes every rank draw the same order, which sharding relies on. Their
    states are restored afterwards, so the user's own random stream is not disturbed.
    """
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _worker_seed(base_seed: int, worker_id: int, global_rank: int, library: str) -> int:
    """A 128-bit seed that differs whenever any input differs. The library is part of the
    key because ``random`` and numpy seeded with one integer would draw the same numbers."""
    key = f"{base_seed}:{worker_id}:{global_rank}:{library}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")


def seed_worker(base_seed: int, worker_id: int, global_rank: int) -> None:
    """Seed torch, ``random`` and numpy in a DataLoader worker from (base seed, worker, rank).

    torch alone seeds worker ``i`` with ``base_seed + i``, and every rank draws the same
    ``base_seed`` after the same ``seed_everything``: random augmentations would then be
    identical on all ranks. Mixing in the global rank makes them differ per rank too.
    """
    torch.manual_seed(_worker_seed(base_seed, worker_id, global_rank, "torch") % 2**63)
    random.seed(_worker_seed(base_seed, worker_id, global_rank, "random"))
    seed = _worker_seed(base_seed, worker_id, global_rank, "numpy")
    np.random.seed([(seed >> (32 * i)) & 0xFFFFFFFF for i in range(4)])


class SeedWorker:
    """A ``worker_init_fn`` that seeds the worker per rank, then calls the user's own one.

    A class rather than a closure so that loaders using the ``spawn`` or ``forkserver``
    start methods can pickle it.

    Args:
        global_rank: This process's rank in the run.
        user_fn: The loader's ``worker_init_fn`` before ours, called after seeding so that it
            may reseed on purpose.
    """

    def __init__(self, global_rank: int, user_fn: Callable[[int], Any] | None) -> None:
        self.global_rank = global_rank
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        # torch seeds worker i with base_seed + i before calling us; base_seed is drawn per
        # pass from the loader's generator (or the global one), so it changes every epoch.
        base_seed = torch.initial_seed() - worker_id
        seed_worker(base_seed, worker_id, self.global_rank)
        if self.user_fn is not None:
            self.user_fn(worker_id)
