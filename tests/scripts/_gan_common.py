"""A GAN as users write it (the shape of pytorch/examples' DCGAN), shared by tests/scripts/gan.py
and the plain-torch reference in tests/test_gan.py, which runs the same loop on one process
over the global batch (both ranks' rows).

Tiny models (Linear layers), a batch of 4 rows per rank, 3 steps with Adam: enough for a
gradient that leaks from one model's backward into the other's step to show (Adam's moments
carry it on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Z, FEATURES, BATCH, STEPS = 3, 2, 4, 3
# name: (zero_grad before each backward or after each step, the discriminator frozen for the
# generator's step, the discriminator's loss on fake.detach())
PATTERNS = {
    "recipe": ("before", False, True),
    "frozen": ("before", True, True),
    "frozen_zero_after_step": ("after", True, True),
    "undetached": ("before", True, False),
}


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The generator, the discriminator and their Adam optimizers."""
    torch.manual_seed(seed)
    g = torch.nn.Sequential(torch.nn.Linear(Z, 6), torch.nn.Tanh(), torch.nn.Linear(6, FEATURES))
    d = torch.nn.Sequential(torch.nn.Linear(FEATURES, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    return g, d, torch.optim.Adam(g.parameters(), lr=0.05), torch.optim.Adam(d.parameters(), lr=0.05)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s real rows and noise at ``step`` (different on every rank)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, FEATURES, generator=gen) + 1.0, torch.randn(BATCH, Z, generator=gen)


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [batch(step, rank) for rank in range(world_size)]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def train(
    g: Any,
    d: Any,
    opt_g: torch.optim.Optimizer,
    opt_d: torch.optim.Optimizer,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    backward: Callable[[torch.Tensor, Any], None],
    pattern: str,
    on_step: Callable[[str], None] = lambda where: None,
) -> None:
    """``STEPS`` steps of the discriminator then the generator, whose loss runs through the
    discriminator (DCGAN's ``errG = criterion(netD(fake), label)``).

    Patterns (see ``PATTERNS``):
        recipe: each model's gradients zeroed before its backward (``opt.zero_grad()`` on even
            steps, ``model.zero_grad()`` on odd ones, as DCGAN's ``netD.zero_grad()``); in
            plain torch the generator's backward also fills the discriminator's gradients,
            which its zero_grad clears before they are used.
        frozen: the recipe with the discriminator frozen for the generator's step
            (``d.requires_grad_(False)`` before ``d(fake)``, ``True`` again after the backward):
            the gradients still flow through it, and none reach its parameters.
        frozen_zero_after_step: as frozen, zeroing after each step (``opt.step();
            opt.zero_grad()``).
        undetached: as frozen, with the discriminator's loss on ``fake`` itself: its backward
            reaches the generator's parameters too (cleared by the generator's zero_grad).

    ``on_step`` is told where the loop is before each backward (``"step 1: d"``).
    """
    zero, freeze, detach = PATTERNS[pattern]
    for step in range(STEPS):
        real, z = batches(step)
        fake = g(z)
        loss_d = _bce(d(real), 1.0) + _bce(d(fake.detach() if detach else fake), 0.0)
        if zero == "before":
            opt_d.zero_grad() if step % 2 == 0 else d.zero_grad()
        on_step(f"step {step}: d")
        backward(loss_d, d)
        opt_d.step()
        if zero == "after":
            opt_d.zero_grad()

        if freeze:
            d.requires_grad_(False)
        loss_g = _bce(d(fake if detach else g(z)), 1.0)
        if zero == "before":
            opt_g.zero_grad() if step % 2 == 0 else g.zero_grad()
        on_step(f"step {step}: g")
        backward(loss_g, g)
        if freeze:
            d.requires_grad_(True)
        opt_g.step()
        if zero == "after":
            opt_g.zero_grad()


def reference(pattern: str, world_size: int) -> dict[str, dict[str, list[float]]]:
    """The parameters plain torch gives on one process over the global batch."""
    g, d, opt_g, opt_d = build()
    train(g, d, opt_g, opt_d, lambda step: global_batch(step, world_size), lambda loss, _: loss.backward(), pattern)
    return {"g": flat(g.state_dict()), "d": flat(d.state_dict())}


def flat(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Every entry of a state dict as a list of floats (full tensors of FSDP's DTensors)."""
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    return {k: v.detach().float().flatten().tolist() for k, v in sorted(full.items())}
