"""``lite.load_pretrained``: pretrained weights into a set-up model, each rank reading its part."""

from __future__ import annotations

import os

import torch

from scopedlite._api.current import current
from scopedlite._io.pretrained import PretrainedWeights

__all__ = ["load_pretrained"]


def load_pretrained(model: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Load a Hugging Face ``save_pretrained`` folder (or one ``.safetensors`` file) into
    ``model``, under any strategy. Call it on every rank.

    Each rank reads only the part of each tensor it holds (its FSDP rows, its ZeRO-3
    partition), so a model built with ``lite.sharded_init(empty=True)`` gets its weights
    without a full copy on any rank::

        with lite.sharded_init(empty=True):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        model, opt = lite.setup(model, torch.optim.AdamW(model.parameters()))
        lite.load_pretrained(model, path)

    Args:
        model: The model ``lite.setup`` returned (or a plain model).
        path: A folder written by ``save_pretrained`` (``model.safetensors`` or its sharded
            form with ``model.safetensors.index.json``), or a ``.safetensors`` file.
        strict: Refuse names the model has and the file lacks, or the other way round
            (tied weights count once). False loads the names both have.

    Raises:
        ValueError: Mismatched names (``strict``) or shapes; a model built with
            ``lite.sharded_init()`` under FSDP that is not set up yet.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"lite.load_pretrained takes a torch.nn.Module, got {type(model).__name__}.")
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError(
            f"The {type(model).__name__} is still on the meta device (built inside "
            "lite.sharded_init() and not set up): its shards exist once it is. Set it up first: "
            "`model, opt = lite.setup(model, opt)`, then `lite.load_pretrained(model, path)`."
        )
    current().strategy.load_weights(model, PretrainedWeights(path), strict)
