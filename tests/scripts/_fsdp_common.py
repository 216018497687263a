"""Model, data and the training recipe shared by the FSDP scripts and their single-process
references (the test process replays the same recipe on one process)."""

from __future__ import annotations

from typing import Any, Callable

import torch

IN, HIDDEN = 16, 64
STEPS = 3  # plain steps, then one accumulation step with clipping
BATCH = 8  # global batch: rank r takes rows r::2
CLIP = 0.05
# lite.join under HSDP (4 ranks, tests/scripts/hsdp.py): rank r reads JOIN_BATCHES[r] batches of
# JOIN_BATCH rows of its own, one rank none at all
JOIN_BATCH, JOIN_BATCHES = 2, (3, 1, 0, 2)
JOIN_SEED, JOIN_CLIP = 3, 0.5


def join_rows(rank: int) -> list[int]:
    """The rows rank ``rank`` reads inside lite.join: a block of its own after the ranks before it."""
    start = JOIN_BATCH * sum(JOIN_BATCHES[:rank])
    return list(range(start, start + JOIN_BATCH * JOIN_BATCHES[rank]))


def make_net() -> torch.nn.Module:
    """Built from the current RNG state: the seed is set by the caller."""
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.LayerNorm(HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def make_data(n: int = BATCH * (STEPS + 2), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Targets in the output's dtype (bf16 under bf16-mixed): before torch 2.12, backward through
    # a loss of two dtypes fails ("Found dtype Float but expected BFloat16").
    return torch.nn.functional.mse_loss(out, y.to(out.dtype))


def one_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    backward: Callable[[torch.Tensor], None],
) -> None:
    """One plain step on ``batch`` (this process's rows of it)."""
    x, y = batch
    backward(_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rows: Callable[[slice], tuple[torch.Tensor, torch.Tensor]],
    backward: Callable[[torch.Tensor], None],
    no_sync: Callable[[bool], Any],
    clip: Callable[[], torch.Tensor],
) -> float:
    """STEPS plain steps, then one step of two accumulated micro-batches, clipped by norm.

    ``rows(slice)`` returns this process's share of the global rows in the slice. Returns the
    gradient norm before clipping of the last step.
    """
    for step in range(STEPS):
        one_step(model, opt, rows(slice(BATCH * step, BATCH * (step + 1))), backward)
    start = BATCH * STEPS
    for micro in range(2):
        x, y = rows(slice(start + BATCH * micro, start + BATCH * (micro + 1)))
        with no_sync(micro == 0):
            backward(_loss(model(x), y) / 2)
    norm = clip()
    opt.step()
    opt.zero_grad()
    return float(norm)


def reference(
    kind: str, seed: int = 0, norms: dict[str, float] | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, float]:
    """One process, whole global batches: what 2 data-parallel ranks must compute.
    ``norms``, if given, receives the inf- and 1-norms of the gradient that is clipped."""
    import contextlib

    torch.manual_seed(seed)
    model = make_net()
    opt = make_optimizer(kind, model.parameters())
    x, y = make_data()
    norm = train(
        model,
        opt,
        lambda s: (x[s], y[s]),
        lambda loss: loss.backward(),
        lambda _: contextlib.nullcontext(),
        lambda: (_record_norms(model, norms), torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))[1],
    )
    return model, opt, norm


def _record_norms(model: torch.nn.Module, norms: dict[str, float] | None) -> None:
    if norms is not None:
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        norms.update(norm_inf=grads.abs().max().item(), norm_1=grads.abs().sum().item())


def probe() -> torch.Tensor:
    return torch.linspace(-1, 1, 3 * IN).reshape(3, IN)


def plain_run_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """What a plain torch run saves (``model.state_dict()``, ``opt.state_dict()``): a net of
    seed 5 after one AdamW step on the first global batch, in one process."""
    torch.manual_seed(5)
    model = make_net()
    opt = make_optimizer("adamw", model.parameters())
    x, y = make_data()
    one_step(model, opt, (x[:BATCH], y[:BATCH]), lambda loss: loss.backward())
    return model.state_dict(), opt.state_dict()


def step_after_plain_load(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rows: Callable[[slice], tuple[torch.Tensor, torch.Tensor]],
    backward: Callable[[torch.Tensor], None],
) -> None:
    """The step a resumed run takes after loading :func:`plain_run_state`: the second global
    batch, ``rows`` giving this rank's part of it (the whole batch in one process)."""
    one_step(model, opt, rows(slice(BATCH, 2 * BATCH)), backward)
