"""One short 2-rank DDP run that stamps each phase of its start, for ``launch_timeline.py``.

argv: MODE OUT [torchrun arguments...], MODE one of:
  script   ``lite.launch(strategy="ddp")``: this process is rank 0, rank 1 re-executes it;
  fork     ``lite.launch(strategy="ddp_fork")``: rank 1 is forked from this process;
  agent    this process is torchrun's agent: ``torch.distributed.run.main`` with the rest of
           argv (which starts this script again, twice, in mode ``torchrun``);
  torchrun a worker torchrun started: the same run in plain torch (``init_process_group``,
           ``DistributedDataParallel``).

Every process appends ``phase time.time()`` lines to ``OUT.<pid>`` (wall clock: the driver's
start stamp comes from another process). The store and the process group are stamped by
wrapping ``torch.distributed.TCPStore`` and ``init_process_group`` in this process, which
both scopedlite and torch look up on the module at call time; nothing else is changed. The
body is the same in all modes: a ``Linear(8, 8)`` set up for DDP, one barrier, one step.
"""

from __future__ import annotations

import os
import sys
import time

_T0 = time.time()  # as early as this script can see: the interpreter has started
mode, out = sys.argv[1], sys.argv[2]


def stamp(phase: str, at: float | None = None) -> None:
    with open(f"{out}.{os.getpid()}", "a") as f:
        f.write(f"{phase} {at if at is not None else time.time()!r}\n")


stamp(
    "role "
    + ("launcher" if mode in ("script", "fork", "agent") and "SCOPEDLITE_LAUNCH_TOKEN" not in os.environ else "worker")
)
stamp("start", _T0)
if mode == "fork":  # a forked worker's first moment of its own (what came before is the parent's)
    os.register_at_fork(after_in_child=lambda: (stamp("role worker"), stamp("start")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

stamp("torch")


def _stamped(function, phase: str):  # a thin timing wrapper
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        stamp(phase)
        return result

    return wrapper


dist.init_process_group = _stamped(dist.init_process_group, "group")
dist.TCPStore = _stamped(dist.TCPStore, "store")

if mode == "agent":
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
    from torch.distributed.run import main

    static_tcp_rendezvous.TCPStore = dist.TCPStore  # imported by name there
    main(sys.argv[3:])
    sys.exit(0)


def body(barrier, backward) -> None:  # the same steps under both APIs
    barrier()
    stamp("barrier")
    backward()
    stamp("step")


torch.manual_seed(0)
if mode == "torchrun":
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    stamp("first_line")
    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    stamp("setup")
    body(dist.barrier, lambda: model(torch.ones(4, 8)).sum().backward())
    dist.destroy_process_group()
    stamp("block_end")
else:
    import scopedlite as lite

    launch = lite.launch
    stamp("ours")
    strategy = {"script": "ddp", "fork": "ddp_fork"}[mode]
    with launch(strategy=strategy, devices=2, accelerator="cpu"):
        stamp("first_line")
        model = lite.setup(torch.nn.Linear(8, 8))
        stamp("setup")
        body(lite.barrier, lambda: lite.backward(model(torch.ones(4, 8)).sum()))
    stamp("block_end")
