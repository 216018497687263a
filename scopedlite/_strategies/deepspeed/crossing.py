"""A loss for one engine whose gradients would reach another engine's parameters (a GAN).

In plain torch a GAN's generator loss, ``bce(d(g(z)), ones)``, also fills the discriminator's
gradients as it runs through it; they do no harm because the recipe zeroes them
(``opt_d.zero_grad()``) before the discriminator's next backward. Under DeepSpeed the
discriminator is an engine, and every gradient reaching its parameters fires its ZeRO hooks
in a backward that is not its own: at stage 1 its next step used them (silently different
from plain torch), at stage 2 it refused to reduce a partition twice, at stage 3 it found a
parameter twice in its reduction bucket. Leaving those parameters out of the backward
(``loss.backward(inputs=...)``) needs DeepSpeed's torch-style backward
(``engine.scale(loss).backward(...)``) instead of ``engine.backward``, and was tried: exact for
DCGAN's generator step, but a discriminator loss through the generator (two forwards of the
discriminator into one loss) left the discriminator's gradients unreduced (its engine's
backward bookkeeping counts one prologue per forward) and its step failed. Not exact either.

So such a loss is refused before its backward starts, on every rank alike (each walks the same
graph), with the way out: freeze the other model for that loss
(``d.requires_grad_(False)`` before the forward the loss runs through, ``True`` again after
the backward). The gradients still flow *through* it and none reach its parameters, so none
of its engine's gradient hooks fires (its output hooks still open and close an empty backward
of its own), and both models end as in plain torch at stages 1-3 (tests/test_gan.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from scopedlite._strategies.deepspeed.engines import EngineRecord

__all__ = ["leaves_reached", "refuse_crossing", "refuse_stage_0"]


def leaves_reached(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (parameters, inputs that require grad) whose gradients
    ``loss.backward()`` computes, each once: the variables of the graph's AccumulateGrad nodes."""
    reached: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if variable is not None:
            reached.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(reached.values())


def refuse_crossing(
    target: EngineRecord, records: Sequence[EngineRecord], leaves: list[torch.Tensor], stage: int
) -> None:
    """Raise if the loss whose graph reaches ``leaves`` would give gradients to the parameters
    of an engine other than ``target`` (the one its ``lite.backward`` drives)."""
    reached = {id(leaf) for leaf in leaves}
    others = [r for r in records if r is not target and r.parameter_ids & reached]
    if not others:
        return
    if stage == 0:
        raise refuse_stage_0(target.name)
    other = others[0].name
    raise RuntimeError(
        f"lite.backward(loss, model=...) for the {target.name}: the loss also reaches the "
        f"parameters of the {other} (as a GAN's generator loss runs through the "
        "discriminator). In plain torch it fills their gradients, which a zero_grad() discards "
        "before they are used; under strategy='deepspeed' that model's engine would reduce "
        "them in a backward not its own, and its next step would differ or fail. Freeze it for "
        "this loss, so that the gradients flow through it without reaching its parameters: "
        "`other.requires_grad_(False)` before the forward this loss runs through it, "
        "`other.requires_grad_(True)` after this backward (e.g. around `loss_g = "
        "bce(d(fake), ones)` ... `lite.backward(loss_g, model=g)`). For a discriminator's own "
        "loss, pass it `fake.detach()`."
    )


def refuse_stage_0(target: str) -> RuntimeError:
    """The error for a loss that runs through another engine's forward at ZeRO stage 0, where
    that engine's output hooks accept no backward but its own ``engine.backward`` (even with
    its parameters frozen)."""
    return RuntimeError(
        f"lite.backward(loss, model=...) for the {target}: the loss runs through the forward of "
        "another model set up in this run, and at ZeRO stage 0 a DeepSpeed engine takes part in "
        "no backward but its own, even frozen. Use strategy='ddp' (what stage 0 does), or a "
        "ZeRO stage 1-3 (`strategy='deepspeed_stage_1'`) with the other model frozen for this "
        "loss."
    )
