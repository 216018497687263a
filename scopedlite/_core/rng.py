"""The states of the random generators a training step draws from, as checkpoint data.

torch (CPU, and every CUDA device where CUDA is initialised), numpy's global generator,
Python's ``random``, and optionally one ``torch.Generator`` of the
user's (a loader's ``generator=``). A state is a dict of tensors, ints, strings and lists
only, so ``torch.load(weights_only=True)`` reads it back: numpy's state is an array, which
that safe loader refuses, and is stored as a tensor.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "restore"]


def capture(generator: torch.Generator | None = None) -> dict[str, Any]:
    """The current states of the global generators (and of ``generator``, if given)."""
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(words), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def restore(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    """Set the generators to ``state`` (from :func:`capture`). Parts this process has no
    generator for (CUDA states saved where CUDA was used) are left out: the other generators
    are still restored exactly."""
    torch.set_rng_state(state["torch"])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])
