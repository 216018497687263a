"""Loss scaling for fp16 mixed precision ("16-mixed") on accelerators.

Users keep calling ``optimizer.step()`` on the optimizer ``setup`` returned. When losses are
scaled, that call must go through ``GradScaler.step`` and be followed by ``update``, so the
optimizer's ``step`` is rerouted on the instance (not replaced by a wrapper object, so the
optimizer stays an instance of its own class and LR schedulers keep working; see _reroute.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from scopedlite._strategies._reroute import reroute_step

if TYPE_CHECKING:
    from scopedlite._run import Run

__all__ = ["GradientScaling"]


class GradientScaling:
    """A ``torch.amp.GradScaler`` when the run's precision asks for one, else the identity."""

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler

    @classmethod
    def for_run(cls, run: Run) -> GradientScaling:
        if run.precision.scales_gradients and run.accelerator in ("cuda", "mps"):
            return cls(torch.amp.GradScaler(run.accelerator))
        return cls(None)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.scaler is None:
            return optimizer
        scaler = self.scaler

        def scaled_step() -> Any:
            result = scaler.step(optimizer)  # unscales, skips on inf/nan, calls the real step
            scaler.update()
            return result

        reroute_step(
            optimizer,
            scaled_step,
            "optimizer.step(closure) cannot be used with precision='16-mixed': the loss scaler "
            "must see the gradients before the step. Call lite.backward(loss) and then "
            "optimizer.step() without a closure.",
        )
        return optimizer
