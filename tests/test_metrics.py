"""torchmetrics with ``lite.join``: ``update()`` inside the join loop, ``compute()`` after the
join block, gives the exact whole-dataset metric on 2 and 3 ranks with uneven shards."""

from __future__ import annotations

import pytest

from conftest import run_warm

pytest.importorskip("torchmetrics", reason="torchmetrics is in the test extra (pip install scopedlite[test])")

METRICS = """
import json, os, torch, torchmetrics, scopedlite as lite

N = 97  # 2 ranks: 49 + 48 samples, 13 and 12 batches of 4; 3 ranks: 33 + 32 + 32, 9, 8 and 8 batches
g = torch.Generator().manual_seed(0)
x, y = torch.randn(N, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
teacher = torch.nn.Linear(8, 3).double()  # fixed predictions, the same in every process
with torch.no_grad():
    for p in teacher.parameters():
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64)).requires_grad_(False)


def metrics():
    collection = torchmetrics.MetricCollection({
        "acc": torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro"),
        "auroc": torchmetrics.classification.MulticlassAUROC(num_classes=3, thresholds=None),  # cat states
        "mse": torchmetrics.MeanSquaredError(),
        "count": torchmetrics.aggregation.SumMetric(),  # how many samples were seen
    })
    for metric in collection.values():
        metric.set_dtype(torch.float64)  # float64 states (Metric.double() keeps float32)
    return collection


def values(collection):
    return {k: v.item() for k, v in collection.compute().items()}


truth = metrics()
out = {}
for n in (2, 3):
    with lite.launch(accelerator="cpu", strategy="ddp", devices=n, timeout=60) as run:
        net = torch.nn.Linear(8, 3).double()
        model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = lite.setup_dataloader(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4))
        metric = metrics().to(run.device)
        seen = steps = 0
        with lite.join(model):
            for xb, yb in loader:
                loss = torch.nn.functional.cross_entropy(model(xb), yb)   # a real training step
                lite.backward(loss)
                opt.step()
                opt.zero_grad()
                logits = teacher(xb)
                metric["acc"].update(logits, yb)
                metric["auroc"].update(logits.softmax(-1), yb)
                metric["mse"].update(logits[:, 0], yb.double())
                metric["count"].update(torch.ones(len(yb), dtype=torch.float64))
                seen += len(yb)
                steps += 1
        got = values(metric)             # after the join block: every rank calls compute()
        shards = lite.all_gather(torch.tensor([seen, steps]))
        if run.is_global_zero:
            out[n] = {"metrics": got, "shards": shards[:, 0].tolist(), "steps": shards[:, 1].tolist()}
logits = teacher(x)
truth["acc"].update(logits, y)
truth["auroc"].update(logits.softmax(-1), y)
truth["mse"].update(logits[:, 0], y.double())
truth["count"].update(torch.ones(N, dtype=torch.float64))
out["truth"] = values(truth)
with open(os.environ["OUT"], "w") as f:
    json.dump(out, f)
"""


@pytest.mark.timeout(180)
def test_update_in_join_and_compute_after_it_is_the_whole_dataset_metric(tmp_path):
    (tmp_path / "metrics.py").write_text(METRICS)
    result = run_warm(tmp_path / "metrics.py", tmp_path=tmp_path, timeout=170)
    assert result.returncode == 0, result.explain()
    out = result.json()
    truth = out.pop("truth")
    assert truth["count"] == 97
    assert out["2"]["shards"] == [49, 48] and out["3"]["shards"] == [33, 32, 32]
    # uneven: rank 0 runs one more step than the others, which leave the loop early
    assert out["2"]["steps"] == [13, 12] and out["3"]["steps"] == [9, 8, 8]
    for n in ("2", "3"):
        got = out[n]["metrics"]
        assert got["count"] == 97  # every sample once: nothing padded, nothing dropped
        assert got["acc"] == truth["acc"] and got["auroc"] == truth["auroc"]  # counts and sorted sets: exact
        assert got["mse"] == pytest.approx(truth["mse"], rel=1e-12)  # a float64 sum in another order
