"""``lite.sharded_init``: build modules where and how they will live."""

from __future__ import annotations

from typing import Any, ContextManager

from scopedlite._api.current import current
from scopedlite._core.scope import WrapperScope

__all__ = ["sharded_init"]


class _ShardedInit(WrapperScope[None]):
    def __init__(self, empty: bool) -> None:
        self.empty = bool(empty)

    def describe(self) -> str:
        return f"lite.sharded_init(empty={self.empty})"

    def _inner_context(self) -> tuple[ContextManager[Any], None]:
        return current().strategy.module_init_context(self.empty), None


def sharded_init(empty: bool = False) -> _ShardedInit:
    """Modules built inside are created on the run's device and in its parameter dtype.

    Sharding strategies (FSDP, DeepSpeed ZeRO-3) build them without allocating them and give
    each parameter, one at a time, exactly the value a plain build with the same seed gives it
    (initialisation in ``__init__`` and Hugging Face's ``post_init()`` included), keeping only
    this rank's part; what cannot be replayed exactly is refused while the model is built.
    ``empty=True`` skips the random initialisation (values are garbage; deterministic ones such
    as ``ones`` or ``arange`` buffers are kept under sharding strategies): for models whose
    weights are loaded right after (``lite.load``, ``lite.load_pretrained``).
    """
    return _ShardedInit(empty)
