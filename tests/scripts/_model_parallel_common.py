"""Model, data and the training recipe of the model_parallel script and of its one-process
reference in tests/test_model_parallel.py (which replays the recipe with plain torch)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

IN, HIDDEN, OUT = 16, 32, 8
BATCH = 4  # per replica: 2 replicas read 8 rows a step
N_TRAIN = 2 * 4 * BATCH  # 4 steps: 2 plain, then one window of 2 accumulated micro-batches
N_EVAL = 12
CLIP_VALUE, CLIP_NORM = 0.01, 0.05
# lite.join over uneven data-parallel shards: replica 0 reads 5 batches of the training rows,
# replica 1 the 3 after them; a plain loader each (use_distributed_sampler=False).
JOIN_SHARES = (list(range(0, 5 * BATCH)), list(range(5 * BATCH, 8 * BATCH)))
JOIN_SEED, JOIN_CLIP = 3, 0.5
# then a replica with no data: replica 0 accumulates 2 batches into one step, replica 1 reads none
JOIN_EMPTY_SHARES = (list(range(0, 2 * BATCH)), [])
N_JOIN_EVAL = 9  # sharded by the sampler inside join: 5 rows (2 batches) and 4 rows (1 batch)


def make_net() -> torch.nn.Module:
    """The two-layer MLP of docs/strategies.md's plan (0: Colwise, 2: Rowwise), with a
    LayerNorm whose parameters stay outside tensor parallelism (on the data-parallel mesh)."""
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT), torch.nn.LayerNorm(OUT)
    )


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    y = torch.tanh(x[:, :OUT]) + 0.1 * torch.randn(n, OUT, generator=g)
    return torch.arange(n), x, y


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row index, x, y) of the training set."""
    return _rows(N_TRAIN, 1)


def eval_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rows(N_EVAL, 2)


def join_eval_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rows(N_JOIN_EVAL, 4)


def probe() -> torch.Tensor:
    return torch.linspace(-1, 1, 3 * IN).reshape(3, IN)


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[Any],
    backward: Callable[[torch.Tensor], None],
    no_sync: Callable[[bool], Any],
    clip: Callable[..., torch.Tensor],
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Steps 0 and 1 plain (1 clipped by value), steps 2 and 3 one accumulation window
    (2 inside no_sync), clipped by norm. Returns the rows read and the norms before clipping."""
    rows: list[int] = []
    norms: dict[str, torch.Tensor] = {}
    for step, (index, x, y) in enumerate(batches):
        rows += index.tolist()
        loss = torch.nn.functional.mse_loss(model(x), y) / (2 if step >= 2 else 1)
        with no_sync(step == 2):
            backward(loss)
        if step == 2:
            continue
        if step == 1:
            clip(clip_val=CLIP_VALUE)
        if step == 3:
            norms["inf"] = clip(max_norm=1e9, norm_type=float("inf"))
            norms["2"] = clip(max_norm=CLIP_NORM)
        opt.step()
        opt.zero_grad()
    return rows, norms
