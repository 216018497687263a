"""Every use of DeepSpeed's private API, in one place, each with the reason it is unavoidable.

Checked against deepspeed 0.19.8. DeepSpeed is imported by the caller; nothing here imports it.
"""

from __future__ import annotations

import torch

__all__ = ["is_zero3_partitioned"]


def is_zero3_partitioned(module: torch.nn.Module) -> bool:
    """Whether ``module`` was built inside ``deepspeed.zero.Init`` (its parameters partitioned).

    Why private: DeepSpeed marks a partitioned parameter only by the attributes it adds to it
    (``ds_id``, ``ds_tensor``, ...); there is no public predicate. Such a module must not be
    moved with ``.to(device)`` before ``deepspeed.initialize``.
    """
    return any(hasattr(p, "ds_id") for p in module.parameters())
