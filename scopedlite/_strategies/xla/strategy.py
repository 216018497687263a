"""XLA (TPU, and XLA:CPU for testing): ``accelerator="tpu"`` (alias ``"xla"``).

torch_xla lives in the optional extra ``scopedlite[xla]`` and is imported only when an XLA run
starts. Each torch_xla release is built against exactly one torch release (torch-xla 2.9.0
needs torch 2.9.0), so a mismatch is reported before the import, which would otherwise fail
with an undefined C++ symbol.

Two strategies:

- ``"xla_single"`` (:class:`XLASingleDeviceStrategy`): one process, one XLA device. This is
  what ``strategy="auto"`` picks for one device, and the one that runs on XLA:CPU
  (``PJRT_DEVICE=CPU``), where several devices cannot run collectives upstream.
- ``"xla"`` (:class:`XLAStrategy`): one process per TPU chip. The processes are forked like
  the notebook launcher's, so they run the body of the ``with`` block; each then performs the
  per-process PJRT set-up that ``torch_xla.launch``/``xmp.spawn`` perform in theirs (which
  cannot be used directly: they call a function, not the rest of a ``with`` block).

How many XLA devices there are, and whether torch_xla fits this torch, is found in
``scopedlite._hardware.xla`` without importing it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Iterable, Iterator

import torch

from scopedlite._comm import distributed as _distributed
from scopedlite._core.structures import map_tensors
from scopedlite._hardware.xla import import_torch_xla
from scopedlite._private.torch_xla_internals import initialize_tpu_process
from scopedlite._strategies.base import ReduceOp, Rendezvous, Strategy
from scopedlite._strategies.join.collectives import NoJoin
from scopedlite._strategies.one_process import OneProcessCollectives
from scopedlite._strategies.reroute import replace_method

if TYPE_CHECKING:
    from scopedlite._core.run import Placement

__all__ = ["XLASingleDeviceStrategy", "XLAStrategy"]

XLA_PRECISIONS = ("32-true", "bf16-true", "bf16-mixed")


def _xm() -> Any:
    import_torch_xla()
    import torch_xla.core.xla_model as xm

    return xm


def _sync() -> None:
    """End the lazy graph here and run it (``xm.mark_step`` in older torch_xla)."""
    import torch_xla

    sync = getattr(torch_xla, "sync", None)
    if sync is not None:
        sync()
    else:  # torch_xla < 2.6
        _xm().mark_step()


class _XLABase(OneProcessCollectives, Strategy):
    """What both XLA strategies share: placement, the optimizer step, the loader, checkpoints.

    Training code stays unchanged: ``optimizer.step()`` on the optimizer ``setup`` returned
    ends the step's lazy graph and runs it, as ``xm.optimizer_step`` with a barrier does, so
    the graph does not grow across steps.
    """

    accelerators: ClassVar[tuple[str, ...]] = ("xla",)

    def check(self, accelerator: str, world_size: int, precision: str) -> None:
        if precision not in XLA_PRECISIONS:
            raise ValueError(
                f"precision={precision!r} is not supported on XLA by scopedlite; choose one of "
                f"{', '.join(map(repr, XLA_PRECISIONS))} (fp16 mixed precision needs a loss "
                "scaler that torch does not provide for XLA devices)."
            )
        if not self.multi_process and world_size != 1:
            raise ValueError(
                f"strategy={self.name!r} runs one process, but the run asks for {world_size}. "
                "Use strategy='xla' for one process per TPU chip, or devices=1."
            )

    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        import_torch_xla()
        self.place(placement)

    # -- modules and optimizers ---------------------------------------------------------
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move ``module`` to the XLA device. Unlike CPU and CUDA, moving to XLA makes new
        ``Parameter`` objects (XLA tensors cannot take a CPU tensor's place), so the old-to-new
        pairs are kept in the run's registry for :meth:`setup_optimizer` to repoint an optimizer
        made before."""
        before = list(module.parameters())
        module = self.placement.precision.convert_module(module.to(self.placement.device))
        self.set_up.replace(zip(before, module.parameters()))
        return module

    def _repoint(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` hold the XLA parameters its CPU parameters became."""
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                new = self.set_up.successor(p)
                if new is not None and p in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(p)
                params.append(p if new is None else new)
            group["params"] = params
        stray = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p.device.type != "xla"]
        if stray:
            raise ValueError(
                f"The optimizer holds parameters that are not on the XLA device (shapes {stray}). "
                "Pass the model first: `model, opt = lite.setup(model, opt)`, or call "
                "lite.setup(model) before lite.setup_optimizers(opt)."
            )

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Reroute ``optimizer.step`` on the instance for the run: reduce gradients over the processes
        (``xm.reduce_gradients``), step, then run the step's graph (``xm.optimizer_step``)."""
        self._repoint(optimizer)
        original_step = optimizer.step
        reduce = self.placement.world_size > 1

        def step(opt: torch.optim.Optimizer, closure: Any = None) -> Any:
            if reduce:
                _xm().reduce_gradients(opt)
            result = original_step() if closure is None else original_step(closure)
            _sync()
            return result

        replace_method(optimizer, "step", step, self.set_up)  # until the run ends (reroute.py)
        return optimizer

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        try:
            loss.backward(*args, **kwargs)
        except RuntimeError as e:
            if "device_ready_queues_" not in str(e):
                raise
            raise RuntimeError(
                "backward on the XLA device failed because this process ran a backward before "
                "torch_xla was imported: torch's autograd engine sizes its per-device queues "
                "at its first backward, and XLA had none then. Import torch_xla (or start the "
                "XLA launch) before any other training in this process, or run the XLA part in "
                "its own process."
            ) from e

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager[Any]:
        # Gradients are reduced in optimizer.step, never in backward: nothing to skip.
        return contextlib.nullcontext()

    def device_batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """One pass of batches through XLA's parallel loader, as ``MpDeviceLoader`` feeds it.

        A background thread reads the batches and copies the next ones to the device while
        the current step runs (asynchronous host-to-device transfer), and each batch is
        handed out after a step mark (``torch_xla.sync()``), so the previous step's graph
        runs even in a loop that never calls ``optimizer.step()``. ``MpDeviceLoader.__iter__``
        is exactly ``ParallelLoader(loader, [device]).per_device_loader(device)``; the
        ``ParallelLoader`` is kept here to close it when the pass ends, also when the loop
        leaves it early (``break``, an exception): ``MpDeviceLoader`` closes it only at its
        next pass, and a fresh one per pass never, leaving its threads (and the loader's
        worker processes) blocked for the rest of the process.

        An error raised while reading a batch is raised here, after the batches read before
        it, as a plain loader raises it: ``ParallelLoader``'s reading thread only prints it and
        ends the pass, which would look like the end of the data.
        """
        from torch_xla.distributed.parallel_loader import ParallelLoader

        failed: list[BaseException] = []

        def read() -> Iterator[Any]:  # runs in ParallelLoader's reading thread
            try:
                yield from batches
            except Exception as e:  # noqa: BLE001 - handed to the main thread, which raises it
                failed.append(e)

        device = self.placement.device
        parallel = ParallelLoader(read(), [device])
        try:
            yield from parallel.per_device_loader(device)
            if failed:
                raise failed[0]
        finally:
            parallel.close()

    # -- checkpoints: xm.save semantics, tensors moved to CPU (rank 0 writes: lite.save) --
    def module_state(self, module: torch.nn.Module) -> dict[str, Any]:
        return _to_cpu(self.unwrap(module).state_dict())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _to_cpu(optimizer.state_dict())

    def describe(self) -> str:
        return f"strategy={self.name!r}"


class XLASingleDeviceStrategy(_XLABase):
    """One process on one XLA device (a TPU chip, or XLA:CPU with ``PJRT_DEVICE=CPU``)."""

    name: ClassVar[str] = "xla_single"
    multi_process: ClassVar[bool] = False

    def join(self, joinables: tuple[Any, ...], divide_by_initial_world_size: bool) -> Any:
        return NoJoin()  # one process: nothing can be uneven, as under strategy='single'


def _to_cpu(state: Any) -> Any:
    """Run what is pending and copy every tensor to CPU, as ``xm.save`` does before writing."""
    _sync()
    return map_tensors(state, lambda t: t.detach().cpu())


class XLAStrategy(_XLABase):
    """One process per TPU chip; gradients reduced in ``optimizer.step`` as ``xm.optimizer_step``
    does, our collectives mapped to XLA's, ``barrier`` as ``xm.rendezvous``.

    The processes are forked at ``launch`` (so they run the body of the block) and each does
    the per-process PJRT set-up of ``torch_xla.launch``. A small gloo group beside XLA carries
    the launcher's rendezvous and pickled objects for ``broadcast``.

    ``lite.join`` is refused (the strategy has no ``join``, so the scope raises): torch's
    Join lets ranks that ran out of data shadow the others' collectives only on
    torch.distributed process groups, while under XLA every rank's step is one compiled graph
    holding the same collectives.
    """

    name: ClassVar[str] = "xla"
    multi_process: ClassVar[bool] = True
    launcher: ClassVar[str | None] = "fork"

    def start(self, placement: Placement, rendezvous: Rendezvous | None) -> None:
        import_torch_xla()
        self.place(placement)
        if placement.world_size > 1:
            assert rendezvous is not None, "a multi-process XLA run needs a rendezvous"
            initialize_tpu_process(placement.local_rank, placement.local_world_size)
            self.connection = _distributed.init_process_group(
                "gloo", rendezvous.world, timeout=placement.timeout, store=rendezvous.store
            )

    def stop(self) -> None:
        super().stop()
        if self.connection is not None:
            _distributed.destroy_process_group(self.connection)
            self.connection = None

    # -- collectives over XLA (run on the device, inside the lazy graph) --------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        xm = _xm()
        kinds = {"sum": xm.REDUCE_SUM, "mean": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}
        work = tensor.detach().to(self.placement.device)
        if work.dtype == torch.bool:
            work = work.to(torch.int64 if op in ("sum", "mean") else torch.uint8)
        scale = 1.0 / self.placement.world_size if op == "mean" else 1.0
        # all_reduce of a single tensor returns a new tensor and leaves the input alone.
        result = xm.all_reduce(kinds[op], work, scale=scale)
        if tensor.dtype == torch.bool and op in ("max", "min"):
            result = result.bool()
        return result.to(tensor.device)  # type: ignore[no-any-return]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        xm = _xm()
        work = tensor.detach().to(self.placement.device).unsqueeze(0)
        return xm.all_gather(work, dim=0).to(tensor.device)  # type: ignore[no-any-return]

    def broadcast(self, obj: Any, src: int) -> Any:
        if self.placement.world_size == 1:
            return obj
        _sync()  # tensors in obj must be computed before they are copied to CPU and sent
        result = _distributed.broadcast_any(obj, src, torch.device("cpu"))
        return map_tensors(result, lambda t: t.to(self.placement.device))

    def barrier(self) -> None:
        if self.placement.world_size > 1:
            _xm().rendezvous("scopedlite.barrier")
