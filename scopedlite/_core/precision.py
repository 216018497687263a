"""Precision settings: what each precision string means and what it does to a run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from scopedlite._core.structures import map_tensors

__all__ = ["FABRIC_SHORT_NAMES", "PRECISIONS", "Precision", "precision_for"]


@dataclass(frozen=True)
class Precision:
    """One precision mode, as named in Lightning Fabric.

    Attributes:
        name: The string users pass, e.g. ``"bf16-mixed"``.
        autocast_dtype: The dtype of autocast regions, or None for no autocast.
        param_dtype: The dtype modules are converted to, or None to leave them alone.
        scales_gradients: Whether losses are scaled (fp16 autocast on an accelerator).
    """

    name: str
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype | None
    scales_gradients: bool = False

    def unsupported_reason(self, accelerator: str) -> str | None:
        """Why this precision cannot run on ``accelerator``, or None if it can."""
        if self.name == "16-mixed" and accelerator == "cpu":
            return (
                "fp16 mixed precision needs gradient scaling that torch only provides on "
                "accelerators; use precision='bf16-mixed' on CPU"
            )
        if self.name == "64-true" and accelerator == "mps":
            return "MPS has no float64 support; use precision='32-true'"
        return None

    def autocast(self, device_type: str) -> ContextManager[Any]:
        """The autocast region of this precision on ``device_type``.

        A "-true" precision disables any autocast region it is nested in: the innermost
        precision wins.
        """
        if self.autocast_dtype is None:
            return torch.autocast(device_type=device_type, enabled=False)
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def init_dtype(self) -> ContextManager[Any]:
        """Create floating-point tensors in the parameter dtype inside this context."""
        if self.param_dtype is None:
            return contextlib.nullcontext()
        return _default_dtype(self.param_dtype)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.param_dtype is not None:
            module = module.to(dtype=self.param_dtype)
        return module

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point tensors in ``data`` to the parameter dtype ("-true" modes)."""
        if self.param_dtype is None:
            return data
        dtype = self.param_dtype
        return map_tensors(data, lambda t: t.to(dtype) if t.is_floating_point() else t)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("32-true", None, None),
        Precision("64-true", None, torch.float64),
        Precision("16-mixed", torch.float16, None, scales_gradients=True),
        Precision("bf16-mixed", torch.bfloat16, None),
        Precision("16-true", None, torch.float16),
        Precision("bf16-true", None, torch.bfloat16),
    )
}


# Lightning Fabric's short spellings, with Fabric's meaning (its connector maps them so:
# 16 is fp16 *mixed*, "bf16" is bf16 *mixed*, 32 and 64 are the "-true" precisions).
FABRIC_SHORT_NAMES: dict[str, str] = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}

# Names other libraries use, refused with the exact spelling that means the same here.
_OTHER_NAMES = {
    "fp16": ("HF Accelerate's mixed_precision name", "16-mixed"),
    "no": ("HF Accelerate's mixed_precision name", "32-true"),
}


def precision_for(name: object, argument: str = "precision") -> Precision:
    """Look up a precision by name, with an error that lists the valid names.

    Fabric's short spellings are accepted with Fabric's meaning: ``16`` and ``"16"`` are
    ``"16-mixed"``, ``"bf16"`` is ``"bf16-mixed"``, ``32``/``"32"`` are ``"32-true"`` and
    ``64``/``"64"`` are ``"64-true"``.
    """
    key = str(name) if isinstance(name, int) and not isinstance(name, bool) else name
    if isinstance(key, str):
        key = FABRIC_SHORT_NAMES.get(key, key)
        if key in PRECISIONS:
            return PRECISIONS[key]
        if key in _OTHER_NAMES:
            where, replacement = _OTHER_NAMES[key]
            raise ValueError(
                f"{argument}={name!r} is {where}; scopedlite writes it as Fabric does: {argument}={replacement!r}."
            )
    raise ValueError(
        f"{argument}={name!r} is not a precision scopedlite knows. "
        f"Valid choices: {', '.join(repr(k) for k in PRECISIONS)}, or Fabric's short "
        f"spellings {', '.join(repr(k) for k in FABRIC_SHORT_NAMES)} (16, 32, 64 as numbers too)."
    )
