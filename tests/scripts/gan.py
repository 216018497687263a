"""A GAN under one strategy: two models set up separately, the generator's loss through the
discriminator (tests/scripts/_gan_common.py has the loop). Rank 0 writes, for each pattern,
the parameters of both models or the refusal, with where the loop was and the generator's
parameters then.

argv: strategy

``deepspeed_stage_0`` runs the generator's first backward instead, through a trainable and a
frozen discriminator: both refused.
"""

from __future__ import annotations

import sys

import torch

import scopedlite as lite
from _common import write
from _gan_common import PATTERNS, batch, build, flat, train

strategy = sys.argv[1]
devices = 1 if strategy == "single" else 2


def backward(loss: torch.Tensor, model: torch.nn.Module) -> None:
    lite.backward(loss, model=model)


def set_up() -> tuple:
    g, d, opt_g, opt_d = build()
    g, opt_g = lite.setup(g, opt_g)
    d, opt_d = lite.setup(d, opt_d)
    return g, d, opt_g, opt_d


def run_pattern(pattern: str) -> dict:
    """Train freshly set-up models with ``pattern``: their parameters, or the refusal."""
    g, d, opt_g, opt_d = set_up()
    where: list[str] = []
    rank = lite.current().global_rank
    try:
        train(g, d, opt_g, opt_d, lambda step: batch(step, rank), backward, pattern, on_step=where.append)
    except RuntimeError as e:
        return {"refused": str(e), "at": where[-1], "g": flat(g.state_dict())}
    return {"g": flat(g.state_dict()), "d": flat(d.state_dict())}


def generator_backward(frozen: bool) -> str:
    g, d, opt_g, opt_d = set_up()
    real, z = batch(0, lite.current().global_rank)
    d.requires_grad_(not frozen)
    loss_g = torch.nn.functional.binary_cross_entropy_with_logits(d(g(z)), torch.ones(len(z), 1))
    try:
        lite.backward(loss_g, model=g)
    except RuntimeError as e:
        return str(e)
    return "not refused"


if strategy == "deepspeed_stage_0":
    with lite.launch(strategy=lite.DeepSpeedStrategy(stage=0), devices=2, accelerator="cpu", timeout=120) as run:
        result = {"trainable": generator_backward(frozen=False), "frozen": generator_backward(frozen=True)}
        if run.is_global_zero:
            write(result)
    sys.exit(0)

with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=120) as run:
    result = {pattern: run_pattern(pattern) for pattern in PATTERNS}
    if run.is_global_zero:
        write(result)
