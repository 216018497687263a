"""Loss scaling for fp16 mixed precision ("16-mixed") on accelerators.

Users keep calling ``optimizer.step()`` on the optimizer ``setup`` returned. When losses are
scaled, that call must go through ``GradScaler.step`` and be followed by ``update``, so the
optimizer's ``step`` is rerouted on the instance (not replaced by a wrapper object, so the
optimizer stays an instance of its own class and LR schedulers keep working; see ``reroute.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from scopedlite._strategies.reroute import reroute_step

if TYPE_CHECKING:
    from scopedlite._core.run import Placement
    from scopedlite._strategies.set_up import SetUpObjects

__all__ = ["GradientScaling", "ScaledBackward"]


class GradientScaling:
    """A ``torch.amp.GradScaler`` when the run's precision asks for one, else the identity."""

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler

    @classmethod
    def for_placement(cls, placement: Placement) -> GradientScaling:
        if placement.precision.scales_gradients and placement.accelerator in ("cuda", "mps"):
            return cls(torch.amp.GradScaler(placement.accelerator))
        return cls(None)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, set_up: SetUpObjects) -> torch.optim.Optimizer:
        """``optimizer`` with its step through the scaler, for the run of ``set_up``."""
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
            set_up,
        )
        return optimizer


class ScaledBackward:
    """``backward`` and ``clip_gradients`` through the strategy's :class:`GradientScaling`
    (for strategies whose backward is the module's own, scaled for "16-mixed")."""

    scaling: GradientScaling

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.scaling.scale(loss).backward(*args, **kwargs)

    def clip_gradients(self, module, optimizer, max_norm, clip_val, norm_type=2.0):  # type: ignore[no-untyped-def]
        # Scaled gradients must be unscaled before their norm means anything. Under DDP they
        # are already averaged over ranks after backward: local clipping is global.
        self.scaling.unscale(optimizer)
        return super().clip_gradients(module, optimizer, max_norm, clip_val, norm_type)  # type: ignore[misc]
