"""Every use of torch_xla's private API, in one place, each with the reason it is unavoidable.

Checked against torch_xla 2.9.0. Nothing here is imported before an XLA run starts.
"""

from __future__ import annotations

import os

__all__ = ["initialize_tpu_process"]


def initialize_tpu_process(local_rank: int, local_world_size: int) -> None:
    """What ``torch_xla.launch``/``xmp.spawn`` do in each process they start: bind it to its
    TPU chip (``TPU_VISIBLE_CHIPS``, process bounds and addresses) before the runtime starts.

    Needs a TPU; XLA:CPU cannot run several processes with collectives upstream.

    Why private: this is torch_xla's own per-process initializer, the function ``xmp.spawn``
    and ``torch_xla.launch`` run in each worker (``_internal/pjrt.py``). They take a function
    to run, not the rest of a ``with`` block, and there is no public way to set up a process
    that torch_xla did not start.
    """
    if os.environ.get("PJRT_DEVICE", "TPU").upper() != "TPU":
        raise RuntimeError(
            f"strategy='xla' with {local_world_size} processes needs TPU chips "
            f"(PJRT_DEVICE=TPU); PJRT_DEVICE={os.environ.get('PJRT_DEVICE')!r} runs one process "
            "only (devices=1)."
        )
    from torch_xla._internal import pjrt

    pjrt.initialize_multiprocess(local_rank, local_world_size)
