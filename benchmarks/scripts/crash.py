"""How fast a failing rank becomes an error in the main process.

argv: CASE STAMP OUT, CASE one of:
  raise   rank 1 raises while rank 0 waits in a collective (``lite.barrier``);
  sigkill rank 1 kills itself with SIGKILL while rank 0 waits in a collective;
  busy    rank 1 raises while rank 0 runs a pure-Python loop outside any collective.

Rank 1 writes ``time.time()`` to STAMP just before failing; the main process writes the
``time.time()`` at which it caught ``lite.WorkerFailedError`` (and what it said) to OUT.
Wall-clock ``time.time()`` is used because the two stamps come from different processes.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import scopedlite as lite
from workload import write_result

case, stamp, out = sys.argv[1], sys.argv[2], sys.argv[3]
BUSY_LIMIT_S = 30.0  # rank 0 stops spinning by itself if the interrupt never comes
SETTLE_S = 0.3  # lets rank 0 get into its waiting state before rank 1 fails

caught: float | None = None
error: lite.WorkerFailedError | None = None
try:
    with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
        lite.barrier()
        if run.global_rank == 1:
            time.sleep(SETTLE_S)
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            if case == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"benchmark crash ({case})")
        if case == "busy":
            deadline = time.monotonic() + BUSY_LIMIT_S
            spins = 0
            while time.monotonic() < deadline:
                spins += 1
        else:
            lite.barrier()  # rank 1 never arrives
except lite.WorkerFailedError as e:
    caught = time.time()
    error = e

children: list[int] = []
try:
    import psutil

    children = [p.pid for p in psutil.Process().children(recursive=True)]
except ImportError:
    pass

write_result(
    out,
    {
        "case": case,
        "caught": caught,
        "ranks": list(error.ranks) if error else None,
        "summary": str(error).splitlines()[0] if error else None,
        "leftover_children": children,
    },
)
