"""What this machine has and what this process may do: the facts the resolver decides on.

Probing is kept apart from the pure resolver (``scopedlite._plan``), which takes a
:class:`Machine` as an argument, so every decision can be tested with a made-up machine.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scopedlite._hardware.program import this_program
from scopedlite._hardware.xla import xla_device_count, xla_import_problem

__all__ = ["Machine"]


@dataclass(frozen=True)
class Machine:
    """What the resolver needs to know about this machine and this process.

    Attributes:
        cuda_device_count: Number of visible CUDA devices.
        mps_available: Whether Apple's MPS backend is usable.
        cpu_count: CPU cores available to this process.
        cuda_initialized: Whether this process already created a CUDA context (fork unsafe).
        has_script: Whether there is a command line to re-execute (False in notebooks,
            REPLs, scripts read from stdin, and under pytest, whose command line would start
            the test session again).
        script_problem: Why this program's command line cannot start it again (an embedding
            host, a runner such as pdb or runpy), with the way out; None when it can.
        launched_before: Whether this process already ran a multi-process launch block:
            re-executed workers would run that block again, so a later block must fork.
        xla_device_count: XLA devices a launch may use (TPU chips, or 1 XLA:CPU device with
            ``PJRT_DEVICE=CPU``), found without starting the XLA runtime or asking the TPU
            metadata server.
        xla_problem: Why torch_xla cannot be used (missing, or built for another torch), or
            None.
        process_group: ``(rank, world size)`` of a default torch.distributed process group
            that exists already in this process (made by Ray Train, a framework or the
            script), which launch joins; None when there is none.
    """

    cuda_device_count: int = 0
    mps_available: bool = False
    cpu_count: int = 1
    cuda_initialized: bool = False
    has_script: bool = True
    script_problem: str | None = None
    launched_before: bool = False
    xla_device_count: int = 0
    xla_problem: str | None = None
    process_group: tuple[int, int] | None = None

    @classmethod
    def probe(cls, launched_before: bool = False) -> Machine:
        """Describe this machine and process, touching no runtime (fork stays safe)."""
        xla_problem = xla_import_problem()
        # is_available / device_count do not create a CUDA context, so probing keeps fork safe.
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        program = this_program() if _outside_a_session() else None
        has_script = program is not None and program.form not in ("stdin", "interactive")
        return cls(
            cuda_device_count=cuda_count,
            mps_available=bool(torch.backends.mps.is_available()),
            cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
            cuda_initialized=bool(torch.cuda.is_initialized()),
            has_script=has_script,
            script_problem=program.problem if has_script and program is not None else None,
            launched_before=launched_before,
            xla_device_count=xla_device_count(os.environ, installed=xla_problem is None),
            xla_problem=xla_problem,
            process_group=_existing_group(),
        )


def _existing_group() -> tuple[int, int] | None:
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def _outside_a_session() -> bool:
    """Whether this program is not a notebook, a REPL or a test session, whose command
    lines would not run the code again (a script read from stdin is told by its form)."""
    if "PYTEST_CURRENT_TEST" in os.environ:
        return False
    main = sys.modules.get("__main__")
    if main is None or hasattr(sys, "ps1") or sys.flags.interactive:
        return False
    return not ("ipykernel" in sys.modules or ("IPython" in sys.modules and _in_ipython()))


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython  # type: ignore[attr-defined]
    except ImportError:
        return False
    return get_ipython() is not None
