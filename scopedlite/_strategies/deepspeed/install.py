"""Importing DeepSpeed, an optional extra, only when a DeepSpeed run starts."""

from __future__ import annotations

from typing import Any

__all__ = ["import_deepspeed"]

_INSTALL_HINT = "pip install scopedlite[deepspeed]"


def import_deepspeed() -> Any:
    """Import DeepSpeed, or explain how to install it."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            f"strategy='deepspeed' needs the DeepSpeed package, which is not installed: "
            f"{_INSTALL_HINT} (or pip install deepspeed). Import failed with: {e}"
        ) from e
    return deepspeed
