"""lite.throughput, lite.measure_flops and lite.peak_flops.

FLOPs are checked against counts written out by hand (2 * rows * inputs * outputs per Linear
forward; the backward computes the weight's gradient and, except in the first layer, the
input's; a transformer's matmuls and attention scores). Throughput runs on 2 real ranks
under ddp and fsdp in one script (tests/scripts/throughput_run.py): every window's counts
are the hand-counted rows each rank really ran, including inside ``lite.join`` where a rank
runs out first; rates are checked against the counts and the logged time (never against a
wall-clock expectation).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import scopedlite as lite
from scopedlite._hardware.peak_flops import cuda_peak, tpu_peak


def linear_flops(dims: list[int], rows: int, backward: bool) -> int:
    """Hand count for Linear(dims[0], dims[1]), Linear(dims[1], dims[2]), ... on ``rows`` rows."""
    layers = list(zip(dims, dims[1:]))
    forward = sum(2 * rows * i * o for i, o in layers)
    if not backward:
        return forward
    weight_grads = sum(2 * rows * i * o for i, o in layers)
    input_grads = sum(2 * rows * i * o for i, o in layers[1:])  # the first layer's input needs none
    return forward + weight_grads + input_grads


@pytest.mark.parametrize("backward", [False, True])
def test_measure_flops_of_a_linear_stack(backward):
    dims, rows = [5, 7, 11, 2], 3
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(i, o) for i, o in zip(dims, dims[1:])))
        x = torch.randn(rows, dims[0])
    loss_fn = (lambda y: y.sum()) if backward else None
    assert lite.measure_flops(model, lambda: model(x), loss_fn) == linear_flops(dims, rows, backward)


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int, context: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(context, d)
        self.blocks = torch.nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(positions))))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_measure_flops_of_a_small_transformer(device):
    vocab, context, d, heads, layers, batch = 50, 16, 32, 4, 2, 3
    with torch.device(device):
        model = TinyGPT(vocab, context, d, heads, layers)
        idx = torch.randint(0, vocab, (batch, context))
    # Hand count per token: the matmul weights (qkv 3d^2, out d^2, MLP 8d^2 per layer; the
    # head d*vocab; embeddings are lookups) twice, and attention's Q K^T and P V over the
    # full context (2 * 2 * context * d per layer: causal masking saves no FLOPs here).
    tokens = batch * context
    n = layers * (3 * d * d + d * d + 8 * d * d) + d * vocab
    forward = 2 * n * tokens + layers * 2 * 2 * context * d * tokens
    assert lite.measure_flops(model, lambda: model(idx)) == forward
    # Backward: every matmul's two operands need gradients (the first ones come from the
    # embeddings), so twice the forward: torchtitan's 6 N + 12 l h q t per token, exactly.
    total = lite.measure_flops(model, lambda: model(idx), lambda y: y.sum())
    assert total == 3 * forward == (6 * n + 12 * layers * d * context) * tokens


def test_measure_flops_keeps_the_models_gradients():
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    before = model.weight.grad.clone()
    lite.measure_flops(model, lambda: model(torch.randn(4, 3)), lambda y: y.sum())
    assert torch.equal(model.weight.grad, before)
    with pytest.raises(TypeError, match=r"forward_fn must be a callable"):
        lite.measure_flops(model, model(torch.ones(1, 3)))


def test_peak_flops_table():
    assert cuda_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert cuda_peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert cuda_peak("NVIDIA H200", "float16") == 989.4e12
    assert cuda_peak("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert cuda_peak("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert cuda_peak("Tesla V100-SXM2-16GB", "float16") == 125e12
    assert cuda_peak("Tesla V100-PCIE-32GB", "float32") == 14e12
    assert cuda_peak("Tesla V100-SXM2-16GB", "bfloat16") is None  # no bf16 units: no made-up number
    assert cuda_peak("NVIDIA L4", "bfloat16") == 121e12
    assert cuda_peak("NVIDIA L40", "bfloat16") is None  # not the L4, not the L40S
    assert cuda_peak("NVIDIA GeForce RTX 4090", "bfloat16") is None
    assert tpu_peak("v4-8", "bfloat16") == 275e12
    assert tpu_peak("v5litepod-16", "bfloat16") == 197e12
    assert tpu_peak("v5p-8", "bfloat16") == 459e12
    assert tpu_peak("v4-8", "float32") is None
    assert lite.peak_flops() is None  # the default run here is on CPU: no peak
    assert lite.peak_flops("cpu", torch.bfloat16) is None


class Recorder:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def finalize(self, status):
        pass


def test_one_process_windows_and_the_cpu_has_no_peak():
    recorder = Recorder()
    with lite.launch(accelerator="cpu", loggers=recorder):
        with pytest.warns(RuntimeWarning, match=r"logs no MFU: no peak FLOP/s is known for cpu in 32-true"):
            meter = lite.throughput(window=2, flops_per_sample=10.0).__enter__()
        for _ in range(5):
            meter.step(samples=4, tokens=32)
        meter.__exit__(None, None, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a given peak: no warning
            with lite.throughput(window=3, peak_flops=100.0) as meter:
                for _ in range(3):
                    meter.step(flops=8)
    assert [step for step, _ in recorder.calls] == [2, 4, 5, 8]  # the second meter continues at 5
    samples = [m["throughput/samples"] for _, m in recorder.calls[:3]]
    assert samples == [8.0, 16.0, 20.0] and recorder.calls[2][1]["throughput/tokens"] == 160.0
    assert [m["throughput/flops"] for _, m in recorder.calls[:3]] == [80.0, 160.0, 200.0]
    assert not any("mfu" in name for _, m in recorder.calls[:3] for name in m)
    last = recorder.calls[3][1]
    assert "throughput/samples" not in last and last["throughput/flops"] == 24.0
    assert last["throughput/mfu"] == pytest.approx(last["throughput/flops_per_sec"] / 100.0, rel=1e-12)


def test_flops_given_per_step_on_a_cpu_warn_that_mfu_is_not_logged():
    with pytest.warns(RuntimeWarning, match=r"logs no MFU") as caught, lite.throughput(window=1) as meter:
        for _ in range(3):
            meter.step(flops=5)
    assert len(caught) == 1  # once


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"window": 0}, ValueError, r"window=0\): window must be an int >= 1"),
        ({"window": 2.5}, ValueError, r"window=2.5\)"),
        ({"flops_per_sample": 1.0, "flops_per_token": 1.0}, ValueError, r"not both"),
        ({"flops_per_token": -1}, ValueError, r"flops_per_token=-1\): flops_per_token must be a number >= 0"),
        ({"peak_flops": 0}, ValueError, r"peak_flops is one device's FLOP/s"),
        ({"prefix": None}, TypeError, r"prefix must be a str"),
    ],
)
def test_throughput_arguments_checked_at_once(kwargs, error, match):
    with pytest.raises(error, match=match):
        lite.throughput(**kwargs)


def test_step_counts_are_checked():
    with (
        lite.throughput() as meter,
        pytest.raises(ValueError, match=r"meter.step\(samples=-2\): samples must be a number >= 0"),
    ):
        meter.step(samples=-2)
    with pytest.raises(RuntimeError, match="inside its"):
        meter.step()


FLOPS_PER_SAMPLE = linear_flops([4, 8, 1], rows=1, backward=True)  # tests/scripts/_common.make_model

# Per strategy, what rank 0's loggers must get: (step, window's steps, window's samples, ranks
# that counted). A: 6 even steps of 2 rows per rank, window 4. B (continues A's axis at 6): 13
# rows in batches of 2 inside join, rank 0 with 4 batches (2, 2, 2, 1), rank 1 with 3: its
# third batch is in the window of steps 3-4. C: rank 0 with 2 batches of 2 rows, rank 1 with 5
# of 3 (windows closed while rank 0 is out are logged when it is back), then an even join
# block over 12 rows: the window of steps 5-6 holds rank 1's step 5 and both ranks' first.
METERS = [  # (prefix, block, its windows)
    ("throughput/", "A", [(4, 4, 16, 2), (6, 2, 8, 2)]),
    ("throughput/", "B", [(8, 2, 8, 2), (10, 2, 5, 2)]),
    ("c/", "C", [(2, 2, 10, 2), (4, 2, 6, 1), (6, 2, 7, 2), (8, 2, 8, 2)]),
]


@pytest.mark.timeout(180)
def test_throughput_on_two_ranks_under_ddp_and_fsdp(script):
    result = script("throughput_run")
    assert result.returncode == 0, result.explain()
    out = result.json()
    assert out["flops_per_sample"] == FLOPS_PER_SAMPLE == 176
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))  # make_model
    assert lite.measure_flops(model, lambda: model(torch.empty(1, 4, device="meta")), lambda y: y.sum()) == 176
    for strategy in ("ddp", "fsdp"):
        calls = out[strategy]
        for prefix, block in ("throughput/", "A B"), ("c/", "C"):
            expected = [w[0] for p, b, windows in METERS if b in block for w in windows]
            assert [step for step, m in calls if next(iter(m)).startswith(prefix)] == expected, (strategy, calls)
        logged = {step: m for step, m in calls if "throughput/time" in m}
        logged_c = {step: m for step, m in calls if "c/time" in m}
        for prefix, block, windows in METERS:
            total, time = 0, 0.0  # each meter's totals and time start at 0
            for step, steps, samples, ranks in windows:
                m = (logged_c if prefix == "c/" else logged)[step]
                where = f"{strategy} block {block} step {step}"
                total += samples
                seconds = m[f"{prefix}time"] - time
                time = m[f"{prefix}time"]
                assert m[f"{prefix}samples"] == total, where
                assert m[f"{prefix}ranks"] == ranks, where
                assert seconds > 0, where
                assert m[f"{prefix}samples_per_sec"] * seconds == pytest.approx(samples, rel=1e-9), where
                assert m[f"{prefix}steps_per_sec"] * seconds == pytest.approx(steps, rel=1e-9), where
                assert m[f"{prefix}device/samples_per_sec"] == pytest.approx(m[f"{prefix}samples_per_sec"] / 2), where
                if block == "C":
                    assert not any("flops" in name or "tokens" in name for name in m), where
                    continue
                assert m[f"{prefix}flops"] == FLOPS_PER_SAMPLE * total, where
                assert m[f"{prefix}flops_per_sec"] * seconds == pytest.approx(FLOPS_PER_SAMPLE * samples, rel=1e-9)
                # MFU: one device's share of the run's FLOP/s over the given peak (1e9)
                assert m[f"{prefix}mfu"] == pytest.approx(m[f"{prefix}flops_per_sec"] / 2 / 1e9, rel=1e-12), where
                if block == "B":  # 3 tokens per row
                    assert m[f"{prefix}tokens"] == 3 * total, where
                    assert m[f"{prefix}tokens_per_sec"] == pytest.approx(3 * m[f"{prefix}samples_per_sec"]), where
                else:
                    assert f"{prefix}tokens" not in m, where
