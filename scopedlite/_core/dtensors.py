"""Whether a value is a DTensor, without importing ``torch.distributed.tensor``.

No DTensor can exist before that module is imported (FSDP2, tensor parallelism and DTensor's
own users import it), so its class is read from ``sys.modules``: asking never pays the
module's import where nothing is sharded.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dtensor_class", "is_dtensor", "is_whole", "shard_like"]


def dtensor_class() -> type | None:
    """DTensor's class, if anything in this process imported it (else nothing is one)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(value: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(value, cls)


def is_whole(dtensor: Any) -> bool:
    """Whether every rank holds all of ``dtensor`` (replicated on every mesh dimension): not
    a shard, nor a partial sum or norm to be reduced."""
    return all(placement.is_replicate() for placement in dtensor.placements)


def shard_like(full: Any, dtensor: Any) -> Any:
    """The DTensor this rank's part of ``full`` (the whole value, the same on every rank) makes
    when laid out as ``dtensor`` is: each rank cuts its own part, with no communication."""
    from torch.distributed.tensor import distribute_tensor  # a DTensor exists: already imported

    return distribute_tensor(full.to(dtensor.device), dtensor.device_mesh, dtensor.placements, src_data_rank=None)
