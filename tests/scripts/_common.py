"""Model, data and single-process references shared by the multi-process test scripts."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

import scopedlite as lite


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def make_data(n: int, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def torch_join_batch(rank: int, i: int) -> torch.Tensor:
    """Batch ``i`` of ``rank`` in torch_join.py (and in its test's plain-torch reference)."""
    return torch.arange(8.0).reshape(2, 4) / (1 + rank + 3 * i)


def params(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def full_params(model: torch.nn.Module) -> list[list[float]]:
    """The model's full parameters, a sharded one's gathered (every rank calls it then)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist() for p in model.parameters()
    ]


def fsdp_over_data_parallel(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """A model_parallel plan: FSDP2 over the mesh's data-parallel dimension (the root sharded)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def max_diff(got: Any, expected: Any, what: str = "value", relative: bool = False) -> float:
    """The largest absolute (or, with ``relative``, relative) difference between two nested
    structures of numbers (lists, tuples, dicts), after checking that they have the same shape:
    the same lengths and the same keys at every level.

    Fails, instead of returning a number that passes, where a comparison would see nothing or
    a value no tolerance can judge: a shortened list or a missing key (``zip`` would skip it),
    an empty list anywhere in the reference (``[[], []]`` compares no number), and a NaN or an
    infinity on either side (``max()`` drops a NaN unless it comes first, and ``inf - inf`` is
    NaN). The worst difference is kept by hand for the same reason."""
    worst = 0.0
    for where, g, e in _leaves(got, expected, what):
        assert math.isfinite(g), f"{where}: got {g!r}, a non-finite value"
        assert math.isfinite(e), f"{where}: the reference is {e!r}, a non-finite value"
        if relative:
            assert e != 0, f"{where}: a relative difference to a reference of 0"
        diff = abs(g - e) / abs(e) if relative else abs(g - e)
        worst = diff if diff > worst else worst
    return worst


def _leaves(got: Any, expected: Any, what: str) -> Iterator[tuple[str, float, float]]:
    """Each pair of numbers at the same place in ``got`` and ``expected``, checking the shape."""
    if isinstance(expected, dict):
        assert isinstance(got, dict), f"{what}: got {type(got).__name__}, expected a dict"
        assert sorted(got) == sorted(expected), f"{what}: keys {sorted(got)} != {sorted(expected)}"
        assert expected, f"{what}: the reference is empty: nothing would be compared"
        for k in expected:
            yield from _leaves(got[k], expected[k], f"{what}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)), f"{what}: got {type(got).__name__}, expected a list"
        assert len(got) == len(expected), f"{what}: {len(got)} items, expected {len(expected)}"
        assert expected, f"{what}: the reference is empty: nothing would be compared"
        for i, (g, e) in enumerate(zip(got, expected)):
            yield from _leaves(g, e, f"{what}[{i}]")
        return
    assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{what}: got {got!r}, expected a number"
    assert isinstance(expected, (int, float)) and not isinstance(expected, bool), (
        f"{what}: the reference is {expected!r}, not a number"
    )
    yield what, got, expected


def assert_close(got: Any, expected: Any, tol: float = 1e-5, what: str = "value", relative: bool = False) -> None:
    """``max_diff(got, expected) <= tol``, saying by how much and where it differs."""
    worst = max_diff(got, expected, what, relative)
    assert worst <= tol, f"{what}: differs from the reference by {worst:.3g} (allowed {tol:.1g})"


def reductions_during(fn: Any, kind: str = "reduce") -> int:
    """How many reducing collectives (all-reduce, reduce-scatter, reduce) this rank ran
    during ``fn()``, counted from torch's profiler, which records every ``c10d`` op: those
    torch.distributed's Python functions call (FSDP2, DeepSpeed) and those DDP's reducer calls
    from C++. A backward whose gradients are not synchronised runs none. ``kind``: only ops
    whose name has it (``"reduce_scatter"``: FSDP's gradient reduction, not tensor
    parallelism's all-reduces, which are part of the computation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("c10d::") and kind in e.name)


def write(obj: Any) -> None:
    with open(os.environ["OUT"], "w") as f:
        f.write(json.dumps(obj))  # json.dump encodes in Python; dumps in C (seconds for big records)


def from_every_rank(obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order, on every rank: each sent as one JSON
    string, so a big record (lists of floats) is one leaf, not a walk over every number."""
    run = lite.current()
    return [
        json.loads(lite.broadcast(json.dumps(obj) if run.global_rank == r else None, src=r))
        for r in range(run.world_size)
    ]


def shards(n: int, world_size: int, pad: bool) -> list[list[int]]:
    """Indices each rank reads: strided, padded by repetition when asked (as our sampler)."""
    items = list(range(n))
    if pad:
        total = -(-n // world_size) * world_size
        items = (items * (-(-total // n)))[:total]
    return [items[r::world_size] for r in range(world_size)]


def batches(indices: list[int], batch_size: int) -> list[list[int]]:
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def reference_training(
    n: int, world_size: int, batch_size: int, lr: float = 0.1, pad: bool = False, divide_by_initial: bool = True
) -> torch.nn.Module:
    """One process replaying what DDP computes: per step, each active rank's mean-loss
    gradient, summed and divided by the initial world size (joined ranks add zero), or by
    the number of ranks still active when ``divide_by_initial`` is False."""
    model = make_model()
    data = make_data(n)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    per_rank = [batches(s, batch_size) for s in shards(n, world_size, pad)]
    for step in range(max(len(b) for b in per_rank)):
        opt.zero_grad()
        total = [torch.zeros_like(p) for p in model.parameters()]
        active = 0
        for rank_batches in per_rank:
            if step >= len(rank_batches):
                continue
            active += 1
            idx = rank_batches[step]
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / (world_size if divide_by_initial else active)
        opt.step()
    return model


class NetWithMethods(torch.nn.Module):
    """A model with methods of its own: one runs no forward, one a forward never
    back-propagated, one a loss (tests/scripts/user_methods.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).mean()

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self(x), y)


def micro_batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of ``rank`` at ``step`` (4 rows; the target is the row sum)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(4, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def save_on_some_ranks_reference():
    """Plain torch, one process, on save_on_some_ranks.py's data: each step the mean of the
    two ranks' losses (the saves and loads rank 0 tried alone change nothing)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [
        [torch.randn(4, 4, generator=g) for _ in range(4)]
        for g in (torch.Generator().manual_seed(30 + r) for r in (0, 1))
    ]
    for step in range(4):
        (sum(model(data[r][step]).pow(2).mean() for r in (0, 1)) / 2).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def check_save_on_some_ranks(seen):
    expected = save_on_some_ranks_reference()
    saved, set_up, loaded, loader = seen[0]["refused"]
    assert saved.startswith("lite.save() was called on rank(s) [0] only (rank 1 went on to the model's forward)"), saved
    assert loaded.startswith("lite.load() was called on rank(s) [0] only"), loaded
    assert "Call lite.save on every rank" in saved
    assert set_up.startswith("lite.setup() was called on rank(s) [0] only (rank 1 went on"), set_up
    assert "`copy.to(run.device)`" in set_up, set_up
    assert loader.startswith("lite.setup_dataloader() was called on rank(s) [0] only (rank 1 went on"), loader
    assert "use_distributed_sampler=False" in loader, loader
    assert seen[0]["read_alone"] == 4  # every row of rank 0's loader, unsharded
    assert seen[1]["refused"] == []
    for rank, out in enumerate(seen):
        assert_close(out["trained"], expected, 1e-5, f"rank {rank} params")
        assert out["loaded"] == out["trained"], f"rank {rank}: the checkpoint saved by every rank did not load back"


def check_skip_on_gathering(result):
    """skip_on_gathering.py's run: it ends with rank 1's refusal, after training as plain torch."""
    assert result.returncode != 0, result.explain()
    refusal = (
        "rank 1 raised RuntimeError: This rank was refused earlier, and the run cannot go on: "
        "This rank is about to run training forward 15"
    )
    assert refusal in result.stderr, result.explain()
    assert "(rank 0 started its backward 7 after 14 training forwards)" in result.stderr, result.explain()
    assert "lite.all_reduce(float(not torch.isfinite(loss))" in result.stderr, result.explain()
    assert "skipped backward was not refused" not in result.stderr, result.explain()
    for rank, out in enumerate(result.json()):
        assert_close(out["trained"], out["reference"], 1e-5, f"rank {rank} params")


def check_scheduler_on_some_ranks(seen, asymmetry):
    """scheduler_on_some_ranks.py's run (``asymmetry``: ``scheduler`` or ``clip`` on rank 0, or
    ``step`` on rank 1, either after ``step-alone,``): the correct part equals plain torch; then refused on
    every rank, each naming what its own optimizer did. ``step-alone`` (DeepSpeed ZeRO): rank
    1's step with no backward since its last is refused at once, on rank 1 alone."""
    *first, asymmetry = asymmetry.split(",")
    for rank, out in enumerate(seen):
        if first == ["step-alone"]:
            alone = out["alone"]
            if rank == 0:
                assert alone is None, alone
            else:
                assert alone is not None, "rank 1's step with no backward since its last was not refused"
                assert alone.startswith("optimizer.step() was called with no backward since the previous step"), alone
                assert "Call lite.backward(loss) before each optimizer.step(), on every rank" in alone, alone
        assert_close(out["trained"], out["reference"], 1e-5, f"rank {rank} params")
        assert out["lr"] == out["lr_ref"] == 0.0125, out  # three scheduler steps
        error = out["error"]
        assert error is not None, f"rank {rank}: the backward after the asymmetry was not refused"
        assert "The ranks' optimizers stepped differently since the previous backward" in error, error
        assert out["refused_at"] == (0 if asymmetry == "step" else 1), out["refused_at"]
        if asymmetry == "scheduler":
            assert f"stepped 1 time(s), the last at learning rates [{0.00625 if rank == 0 else 0.0125}]" in error, error
        elif asymmetry == "clip":
            clipped = ", after lite.clip_gradients(clip_val=0.05). So" if rank == 0 else ". So"
            assert f"stepped 1 time(s), the last at learning rates [0.0125]{clipped}" in error, error
        else:
            assert f"stepped {2 if rank == 1 else 1} time(s), the last at learning rates [0.0125]" in error, error
        assert "scheduler.step(float(lite.all_reduce(val_loss" in error, error
        assert out["after"] == 3.0  # the next collective pairs
