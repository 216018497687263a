"""torch's uneven-input scenarios, and what plain torch computes for them in one process.

The models and schedules of ``test_ddp_uneven_inputs`` and its siblings in
``torch/testing/_internal/distributed/distributed_test.py`` (sizes cut down for CPU), shared by
``join_torch_suite.py`` (which runs them through lite.join) and ``tests/test_join.py``
(which computes the expected values here, rank by rank, with plain torch: no DDP, no
scopedlite).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return self.p + x


class UnusedParamModule(nn.Module):
    """Rank ``unused_params_rank`` skips ``t0``: find_unused_parameters=True."""

    def __init__(self, unused_params_rank: int) -> None:
        super().__init__()
        self.t0 = Task()
        self.t1 = Task()
        self.unused_params_rank = unused_params_rank

    def forward(self, x, rank):
        return self.t1(self.t0(x)) if rank != self.unused_params_rank else self.t1(x)


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x):
        x = torch.reshape(self.fc1(x), (-1, 4, 10))
        x = self.bn(x)
        x = torch.reshape(x, (-1, 40))
        return F.softmax(self.fc2(x), dim=1)


DIM = 20
CONV = 14
STEP = 1e-3  # torch's hand-written step ascends by the gradient: here a small descent, no overflow


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "small":
        return nn.Linear(DIM, DIM, bias=False)
    if kind == "conv":
        return nn.Sequential(
            nn.Conv2d(1, 20, 3), nn.ReLU(), nn.Conv2d(20, 32, 3), nn.ReLU(), nn.Conv2d(32, 16, 5), nn.ReLU()
        )
    if kind == "bn":
        return BatchNormNet()
    if kind == "unused_unjoined":  # the rank that does not join early has unused parameters
        return UnusedParamModule(1)
    if kind == "unused_joined":  # the rank that joins early has unused parameters
        return UnusedParamModule(0)
    if kind == "equivalence":
        return nn.Linear(10, 10, bias=False)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if kind == "bn_mlp":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    raise ValueError(kind)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


def eval_data(n: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    """19 samples: in batches of 3, 2 ranks read 4 and 3 batches, 3 ranks 3, 2 and 2 (uneven)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def reference_eval() -> list[float]:
    x, y = eval_data()
    with torch.no_grad():
        return [F.mse_loss(build("mlp", seed=0)(x), y, reduction="sum").item(), float(len(x))]


def example_input(kind: str) -> torch.Tensor:
    if kind == "equivalence":
        return torch.rand(3, 10, generator=torch.Generator().manual_seed(5))
    raise ValueError(kind)


def step_input(kind: str, rank: int, i: int = 0) -> tuple[Any, ...]:
    """torch's inputs: ones of the model's shape (and the rank for the unused-parameter
    models); for the training suite, (x, y) of rank ``rank``'s i-th batch."""
    if kind == "small":
        return (torch.ones(1, DIM),)
    if kind == "conv":
        return (torch.ones(1, 1, CONV, CONV),)
    if kind == "bn":
        return (torch.ones(1, 2),)
    if kind.startswith("unused"):
        return (torch.ones(1, 2), rank)
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.randn(3, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(3, 1, generator=g)


def mappings(world: int) -> list[dict[int, int]]:
    """torch's iteration mappings: rank 0 (at 3 ranks: ranks 0 and 1, rank 1 later than rank 0)
    joins early by 2, 3 or 10 iterations, from a baseline of 0 (a rank with no iteration at
    all) or 5. (torch also runs one early rank at 3 ranks: the 2-rank run covers its shape.)"""
    found = []
    for early in [2] if world > 2 else [1]:
        for baseline, offset in itertools.product([0, 5], [2, 3, 10]):
            mapping = dict.fromkeys(range(early), baseline)
            if early > 1:
                for r in range(1, early):
                    mapping[r] += offset // 2
            mapping.update(dict.fromkeys(range(early, world), baseline + offset))
            found.append(mapping)
    return found


def scenarios(suite: str, strategy: str, world: int) -> list[dict[str, Any]]:
    """Every scenario of a suite, in the order the script runs them."""
    cases: list[dict[str, Any]] = []
    if suite == "torch":
        # torch: each model with no_sync never, and every (i + 2)-th iteration synced for model i;
        # here every model with intervals 1, 2 and 3.
        for n, (kind, interval, mapping) in enumerate(
            itertools.product(["small", "conv", "bn", "unused_unjoined", "unused_joined"], [1, 2, 3], mappings(world))
        ):
            cases.append(
                {"run": "uneven", "model": kind, "interval": interval, "mapping": mapping, "loader": n % 2 == 0}
            )
        for divide, loader in itertools.product([False, True], [False, True]):
            cases.append({"run": "grad_div", "divide": divide, "loader": loader})
        cases += [{"run": "equivalence", "loader": loader} for loader in (False, True)]
        cases += [{"run": "even", "loader": loader} for loader in (False, True)]
        return cases
    # the training suite, under every strategy
    two = {0: 2, 1: 5} if world == 2 else {0: 2, 1: 4, 2: 5}
    zero = {0: 0, 1: 3} if world == 2 else {0: 0, 1: 3, 2: 5}
    for n, (kind, window, mapping) in enumerate(itertools.product(["mlp", "bn_mlp"], [1, 2, 3], [two, zero])):
        cases.append(
            {
                "run": "train",
                "model": kind,
                "window": window,
                "mapping": mapping,
                "divide": True,
                "clip": "",
                "optimizer": "sgd",
                "loader": n % 2 == 0,
            }
        )
    cases.append(
        {
            "run": "train",
            "model": "mlp",
            "window": 1,
            "mapping": two,
            "divide": False,
            "clip": "",
            "optimizer": "adamw",
            "loader": True,
        }
    )
    cases.append(
        {
            "run": "train",
            "model": "mlp",
            "window": 1,
            "mapping": zero,
            "divide": False,
            "clip": "",
            "optimizer": "sgd",
            "loader": False,
        }
    )
    cases.append(
        {
            "run": "train",
            "model": "mlp",
            "window": 1,
            "mapping": two,
            "divide": True,
            "clip": "norm",
            "optimizer": "adamw",
            "loader": True,
        }
    )
    cases.append(
        {
            "run": "train",
            "model": "mlp",
            "window": 2,
            "mapping": zero,
            "divide": True,
            "clip": "value",
            "optimizer": "sgd",
            "loader": False,
        }
    )
    cases.append({"run": "eval"})
    if strategy != "ddp":  # ddp runs these in the torch suite
        cases.append({"run": "equivalence", "loader": True})
        if strategy == "fsdp":  # deepspeed's engine owns the gradients
            cases += [
                {"run": "grad_div", "divide": False, "loader": True},
                {"run": "grad_div", "divide": True, "loader": False},
            ]
    return cases


# -- what plain torch computes, one process ------------------------------------------------------


def reference_uneven(case: dict[str, Any], world: int) -> dict[str, Any]:
    """torch's Join over DDP, rank by rank: buffers synced before each forward from the highest
    active rank (after a synced iteration), gradients averaged over the world with zeros from
    ranks that have joined, the step by hand on the active ranks, and at the end every rank
    takes the parameters and buffers of the highest of the last ranks to join."""
    kind, interval, mapping = case["model"], case["interval"], case["mapping"]
    models = [build(kind, seed=0) for _ in range(world)]
    sync_buffers_next = True
    for i in range(max(mapping.values())):
        active = [r for r in range(world) if i < mapping[r]]
        sync = i % interval == 0
        if sync_buffers_next and list(models[0].buffers()):
            source = dict(models[max(active)].named_buffers())
            for m in models:
                for n, b in m.named_buffers():
                    b.data.copy_(source[n])
        grads = {}
        for r in active:
            models[r].zero_grad(set_to_none=True)
            models[r](*step_input(kind, r)).sum().backward()
            grads[r] = [p.grad for p in models[r].parameters()]
        if sync:
            averaged = []
            for k in range(len(grads[active[0]])):
                contributions = [grads[r][k] for r in active if grads[r][k] is not None]
                averaged.append(sum(contributions) / world if contributions else None)
            for r in active:
                grads[r] = averaged
        for r in active:
            with torch.no_grad():
                for p, g in zip(models[r].parameters(), grads[r]):
                    if g is not None:
                        p -= STEP * g
        sync_buffers_next = sync
    last = max(r for r in range(world) if mapping[r] == max(mapping.values()))
    return _state(models[last])


def reference_grad_div(case: dict[str, Any], world: int) -> list[list[list[float]]]:
    """torch's expectation per rank and iteration: 50 when dividing by the active ranks,
    50 * active / world when dividing by the initial world size."""
    expected = []
    for rank in range(world):
        n = 3 if rank == 0 else 5
        grads = []
        for i in range(n):
            active = world - (1 if i >= 3 else 0)
            value = 50.0 if not case["divide"] else 50.0 * active / world
            grads.append([value] * 25)
        expected.append(grads)
    return expected


def reference_equivalence(world: int) -> dict[str, Any]:
    model = build("equivalence", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.03)
    x = example_input("equivalence")
    for _ in range(sum(2 * (r + 1) for r in range(world))):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return _state(model)


def reference_even(world: int) -> list[float]:
    return [sum(range(world)) / world] * 5


def reference_train(case: dict[str, Any], world: int, ddp: bool) -> list[dict[str, Any]]:
    """Per rank: SGD (or AdamW) and a StepLR on the gradient summed over the ranks' micro-batches since the last step
    (a rank that ran out contributes what it accumulated once, at the next synchronised
    step), divided by the world size or the running ranks, clipped as asked. Parameters are
    the same on every rank; buffers are each rank's own running statistics under fsdp and
    deepspeed (the ``own_buffers`` entry), and the highest running rank's under ddp."""
    kind, window, mapping = case["model"], case["window"], case["mapping"]
    model = build(kind, seed=0)
    replicas = [copy.deepcopy(model) for _ in range(world)]  # their buffers only
    opt = make_optimizer(case["optimizer"], model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    pending = {r: [torch.zeros_like(p) for p in model.parameters()] for r in range(world)}
    has_pending = dict.fromkeys(range(world), False)
    sync_buffers_next = True
    for i in range(max(mapping.values())):
        active = [r for r in range(world) if i < mapping[r]]
        sync = i % window == window - 1
        # ddp: buffers from the highest active rank, before a forward that follows a synced one
        ddp_buffers = [b.clone() for b in replicas[max(active)].buffers()] if ddp and sync_buffers_next else None
        for r in active:
            x, y = step_input(kind, r, i)
            replica = replicas[r]
            with torch.no_grad():
                for p, q in zip(replica.parameters(), model.parameters()):
                    p.copy_(q)
            if ddp_buffers is not None:
                with torch.no_grad():
                    for b, v in zip(replica.buffers(), ddp_buffers):
                        b.copy_(v)
            replica.zero_grad()
            F.mse_loss(replica(x), y).backward()
            for acc, p in zip(pending[r], replica.parameters()):
                acc += p.grad
            has_pending[r] = True
        sync_buffers_next = sync
        if not sync:
            continue
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(world):
            if has_pending[r]:
                for t, acc in zip(total, pending[r]):
                    t += acc
                pending[r] = [torch.zeros_like(p) for p in model.parameters()]
                has_pending[r] = False
        divisor = world if case["divide"] else len(active)
        for p, t in zip(model.parameters(), total):
            p.grad = t / divisor
        if case["clip"] == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif case["clip"] == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
        sched.step()
        opt.zero_grad()
    last = max(r for r in range(world) if mapping[r] == max(mapping.values()))
    lr = opt.param_groups[0]["lr"]
    moments = _moments(opt)
    return [
        {
            "params": _state(model)["params"],
            "buffers": _state(replicas[last if ddp else r])["buffers"],
            "lr": lr,
            "moments": moments,
        }
        for r in range(world)
    ]


def _moments(opt: torch.optim.Optimizer) -> list[list[float]]:
    """The optimizer's state tensors (momentum, AdamW's moments; not the step counts), as
    join_torch_suite.py reports a ddp rank's."""
    return [
        t.flatten().tolist() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0
    ]


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "buffers": [b.detach().double().flatten().tolist() for b in model.buffers()],
    }
