"""The baseline of ``crash.py``'s ``raise`` case under raw torchrun + torch.distributed.

argv: STAMP. Run as ``python -m torch.distributed.run --nproc-per-node 2 crash_torchrun.py
STAMP``: rank 1 writes ``time.time()`` to STAMP and raises while rank 0 waits in
``dist.barrier()``. What a torchrun user sees of the failure is the command ending with its
``ChildFailedError`` report, so the benchmark stamps the moment the command exits.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

SETTLE_S = 0.3  # as crash.py: rank 0 gets into its barrier before rank 1 fails

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(SETTLE_S)
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
    raise RuntimeError("benchmark crash (raise, torchrun)")
dist.barrier()  # rank 1 never arrives
