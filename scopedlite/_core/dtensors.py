"""Whether a value is a DTensor, without importing ``torch.distributed.tensor``.

No DTensor can exist before that module is imported (FSDP2, tensor parallelism and DTensor's
own users import it), so its class is read from ``sys.modules``: asking never pays the
module's import where nothing is sharded.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dtensor_class", "is_dtensor"]


def dtensor_class() -> type | None:
    """DTensor's class, if anything in this process imported it (else nothing is one)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_dtensor(value: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(value, cls)
