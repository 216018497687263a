"""Every collective, on tensors, numbers and nested structures; rank 0 writes all results.

Also: shapes, dtypes and nests that differ between ranks raise on every rank (and the run goes
on), and lite.gather_for_metrics of per-rank rows, outside lite.join and inside it over a
set-up loader of an uneven dataset (the test computes the references).

argv: devices [strategy]
"""

import os
import sys
import warnings

import torch

import scopedlite as lite
from _common import make_model, write

devices = int(sys.argv[1])
strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
N = 21 if devices == 2 else 20  # uneven: shares of 11 + 10, or 7 + 7 + 6, inside lite.join
IDS = torch.randperm(N, generator=torch.Generator().manual_seed(5)) * 10  # a sample's value: not its index


def plain(obj):
    if isinstance(obj, torch.Tensor):
        return obj.item()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def refused(fn):
    """What calling ``fn`` raised on this rank: (exception type, message), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test names the type it expects
        return [type(e).__name__, str(e), isinstance(e, lite.CollectiveMismatchError), isinstance(e, ValueError)]
    return None


def listed(obj):
    if isinstance(obj, torch.Tensor):
        return [obj.tolist(), str(obj.dtype), list(obj.shape)]
    if isinstance(obj, dict):
        return {k: listed(v) for k, v in obj.items()}
    return obj


def rows(r):
    """Rank r's rows: 5, 3, 1 of them (rank 2), each row [10r + i, -i, i / 2] (float64)."""
    n = 5 - 2 * r
    i = torch.arange(n, dtype=torch.float64)
    return torch.stack([10 * r + i, -i, i / 2], dim=1)


def mismatches(r):
    ragged = torch.arange(4 * (5 - 2 * r), dtype=torch.float32).view(-1, 4)  # (5, 4), (3, 4), (1, 4)
    same_bytes = torch.ones(2, dtype=torch.float64 if r == 0 else torch.int64)  # 16 bytes everywhere
    keys = {"a": torch.ones(2), "b": torch.ones(2)} if r == 0 else {"b": torch.ones(2), "a": torch.ones(2)}
    out = {
        "all_gather": refused(lambda: lite.all_gather(ragged)),
        "all_reduce": refused(lambda: lite.all_reduce(ragged, op="max")),
        "nest": refused(lambda: lite.all_reduce({"loss": torch.ones(()), "rows": [ragged]})),
        "dtype": refused(lambda: lite.all_reduce(same_bytes)),
        "number": refused(lambda: lite.all_gather(1 if r == 0 else 1.5)),
        "keys": refused(lambda: lite.all_reduce(keys)),
        "op": refused(lambda: lite.all_reduce(torch.ones(2), op="sum" if r == 0 else "max")),
        "trailing": refused(lambda: lite.gather_for_metrics(torch.ones(2, 3 + r))),
        "metrics_dtype": refused(
            lambda: lite.gather_for_metrics(torch.ones(2, dtype=torch.float32 if r else torch.int64))
        ),
    }
    out["after"] = lite.all_reduce(torch.tensor([r + 1.0])).tolist()  # the group still works
    return out


def metrics_outside_join(r):
    big = {f"m{k}": rows(r)[:, :2] + k for k in range(20)}  # too big for the check's row
    return {
        "rows": listed(lite.gather_for_metrics(rows(r))),
        "nest": listed(
            lite.gather_for_metrics({"rows": rows(r), "ids": (rows(r)[:, 0]).long(), "count": len(rows(r))})
        ),
        "scalar": listed(lite.gather_for_metrics(r / 2)),
        "zero_d": listed(lite.gather_for_metrics(torch.tensor(r, dtype=torch.int32))),
        "empty_on_last": listed(lite.gather_for_metrics(rows(r) if r < devices - 1 else rows(r)[:0])),
        "none_anywhere": listed(lite.gather_for_metrics(rows(r)[:0])),
        "big": listed(lite.gather_for_metrics(big)["m19"]),
    }


def metrics_over_loader(run):
    """Per-batch gathers over a set-up loader of N samples (batch 2): a padded pass outside
    lite.join, then a pass inside it with a training step, per-batch gathers, and one gather
    after the loop (a rank that finished first waits for the others there)."""
    data = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=torch.Generator().manual_seed(6)), IDS)
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=2))
    padded = [lite.gather_for_metrics(ids).tolist() for _, ids in loader]
    steps, counts, mine = [], [], []
    with lite.join(model):
        for x, ids in loader:
            loss = model(x).pow(2).mean()
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
            got = lite.gather_for_metrics({"ids": ids, "x": x})
            steps.append(got["ids"].tolist())
            counts.append(lite.gather_for_metrics(len(ids)).tolist())
            mine.append(ids)
            ok = torch.equal(got["x"].cpu(), data.tensors[0][[int((i == IDS).nonzero()) for i in got["ids"]]])
            steps[-1].append(ok)
        after = lite.gather_for_metrics(torch.cat(mine)).tolist()
    return {"padded": padded, "steps": steps, "counts": counts, "after": after, "ids": IDS.tolist()}


class Threes(torch.utils.data.Sampler):
    """A user's batch sampler (dealt to ranks whole): the samples in threes, in order."""

    def __iter__(self):
        return iter([list(range(i, min(i + 3, N))) for i in range(0, N, 3)])

    def __len__(self):
        return -(-N // 3)


def padded_passes():
    """Gathers over padded passes (outside lite.join, batch 3): per batch and after the pass,
    over the default sampler and over a user's batch sampler (whole batches repeat there);
    and a per-batch sum, which holds the repeat and cannot be cut: a warning, once a pass."""
    data = torch.utils.data.TensorDataset(IDS)
    sampled = lite.setup_dataloader(torch.utils.data.DataLoader(data, batch_size=3))
    batched = lite.setup_dataloader(torch.utils.data.DataLoader(data, batch_sampler=Threes()))
    out = {}
    for name, loader in (("sampled", sampled), ("batched", batched)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mine = []
            per_batch = []
            for (ids,) in loader:
                per_batch.append(lite.gather_for_metrics(ids).tolist())
                mine.append(ids)
            after = lite.gather_for_metrics(torch.cat(mine)).tolist()
            sums = [lite.gather_for_metrics(ids.sum()).tolist() for (ids,) in loader]
        said = [
            f"{os.path.basename(w.filename)}: {w.message}" for w in caught if "gather_for_metrics" in str(w.message)
        ]
        out[name] = {"per_batch": per_batch, "after": after, "sums": sums, "warned": said}
    return out


with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=60) as run:
    r = run.global_rank
    value = torch.tensor([r + 1.0, -(r + 1.0)])
    out = {
        "sum": lite.all_reduce(value, op="sum").tolist(),
        "mean": lite.all_reduce(value, op="mean").tolist(),
        "max": lite.all_reduce(value, op="max").tolist(),
        "min": lite.all_reduce(value, op="min").tolist(),
        "int_sum": lite.all_reduce(r + 1),
        "int_mean": lite.all_reduce(r + 1, op="mean"),
        "float_max": lite.all_reduce(float(r) / 2, op="max"),
        "bool_max": lite.all_reduce(r == 1, op="max"),
        "nested": plain(lite.all_reduce({"a": [r, torch.tensor(float(r))], "b": (1, 2.5)}, op="sum")),
        "input_unchanged": value.tolist(),
        "gather": lite.all_gather(torch.tensor([r, 10 * r])).tolist(),
        "gather_number": lite.all_gather(r).tolist(),
        "broadcast_tensor": lite.broadcast(torch.arange(3) * 7 if r == 1 else None, src=1).tolist(),
        "broadcast_obj": lite.broadcast({"from": r, "list": [r] * 2}, src=devices - 1),
        "world": [run.world_size, run.local_world_size, run.node_rank],
        "mismatches": mismatches(r),
        "metrics": metrics_outside_join(r),
        "loader": metrics_over_loader(run),
        "padded_passes": padded_passes(),
    }
    lite.barrier()
    marker = os.environ["OUT"] + ".rank0-was-here"
    with lite.rank_zero_first():
        out["rank0_done_before"] = os.path.exists(marker)  # rank 0 leaves its block first
        if run.global_rank == 0:
            open(marker, "w").close()
    everyone = [lite.broadcast(out, src=i) for i in range(run.world_size)]
    lite.print("printed once")
    if run.is_global_zero:
        write(everyone)
