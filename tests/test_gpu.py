"""CUDA paths (NCCL, 16-mixed with loss scaling). Skipped where no GPU is visible."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
    pytest.mark.timeout(180),
]


def test_16_mixed_scales_the_loss_and_trains():
    """The gradient back-propagated into a parameter is the scaler's scale times plain
    torch's (fp16 autocast, unscaled), and the step sees it unscaled again."""
    import scopedlite as lite

    with lite.launch(accelerator="cuda", devices=1, precision="16-mixed"):
        torch.manual_seed(0)
        plain = torch.nn.Linear(8, 1).cuda()
        model = copy.deepcopy(plain)
        model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(32, 8, device="cuda"), torch.randn(32, 1, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            torch.nn.functional.mse_loss(plain(x), y).backward()
        backpropagated = []
        model.weight.register_hook(lambda g: backpropagated.append(g.detach().clone()))
        scaler = lite.current().strategy.scaling.scaler
        scale = scaler.get_scale()
        assert scale > 1.0  # GradScaler's initial 65536
        losses = []
        for step in range(20):
            with lite.autocast():
                loss = torch.nn.functional.mse_loss(model(x), y)
            lite.backward(loss)
            if step == 0:
                torch.testing.assert_close(backpropagated[0] / scale, plain.weight.grad, rtol=1e-2, atol=1e-5)
                opt.step()  # unscales before stepping: the gradient is plain torch's again
                torch.testing.assert_close(model.weight.grad, plain.weight.grad, rtol=1e-2, atol=1e-5)
            else:
                opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ddp_nccl_all_reduce(run_python):
    code = textwrap.dedent(
        """
        import torch, scopedlite as lite
        with lite.launch(accelerator="cuda", devices=2, strategy="ddp") as run:
            assert run.device == torch.device("cuda", run.local_rank)
            assert lite.all_reduce(torch.ones(1, device=run.device)).item() == 2
        """
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.explain()
