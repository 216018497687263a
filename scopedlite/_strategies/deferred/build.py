"""One ``sharded_init`` block of a sharding strategy: record the build, then give each tensor
the value a plain build with the same seed gives it, one tensor at a time.

A plain build draws its random numbers from the CPU generator in the order the code runs:
each layer's own initialisation in ``__init__``, then whatever runs after construction
(Hugging Face's ``post_init()`` walks every module through ``_init_weights``). The block is
recorded on the meta device (``tape.py``). When it closes, the random draws are made once,
in order, on scratch tensors (``Tape.advance``): that gives the generator state each draw
starts from, and leaves the generator where the plain build leaves it. After that any
tensor's value is recomputed on its own from the operations that wrote it
(``DeferredBuild.value``), each draw from its recorded state - so the values are exactly the
plain build's, and no rank ever holds more than one full tensor (and its temporaries).

All ranks recompute rank 0's values, as DDP starts every rank from rank 0's parameters: the
generator state at entry (and any reseeding inside the block) is rank 0's.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

from scopedlite._strategies.deferred.tape import NotReplayable, Recorder, Ref, Tape

__all__ = ["DeferredBuild", "NotReplayable"]


class DeferredBuild:
    """The recording of one ``sharded_init`` block and what is needed to replay it.

    Args:
        empty: ``sharded_init(empty=True)``: random initialisation is skipped (values left as
            allocated), deterministic ones (``ones``, ``arange`` buffers...) are kept.
        agree: Returns rank 0's copy of what it is given (a broadcast from rank 0).
    """

    def __init__(self, empty: bool, agree: Callable[[Any], Any]) -> None:
        self.empty = empty
        self._agree = agree
        self._recorder = Recorder()
        self._states: dict[int, torch.Tensor] | None = None
        # given tensors in the block, in the order they were (the same on every rank)
        self._modules: dict[int, weakref.ref[torch.nn.Module]] = {}
        # registered in the block, by identity (tensors compare by value)
        self._tensors: dict[int, weakref.ref[torch.Tensor]] = {}

    @property
    def tape(self) -> Tape:
        return self._recorder.tape

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the block; replay its random draws when it closes without an error."""
        hooks = torch.nn.modules.module
        handles = [
            hooks.register_module_parameter_registration_hook(self._registered),
            hooks.register_module_buffer_registration_hook(self._registered),
        ]
        self._recorder.begin()
        try:
            with self._recorder:
                yield
        except NotReplayable as error:
            raise NotReplayable(_explain(str(error))) from None
        finally:
            for handle in handles:
                handle.remove()
        self._finish()

    def _registered(self, module: torch.nn.Module, name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            if id(module) not in self._modules or self._modules[id(module)]() is not module:
                self._modules[id(module)] = weakref.ref(module)
            self._tensors[id(tensor)] = weakref.ref(tensor)

    def _finish(self) -> None:
        recorder = self._recorder
        recorder.note_generator()
        if self.empty:
            return
        local = (recorder.start_state, recorder.reseeds, recorder.generator_starts)
        shared = self._agree(_to_cpu(local))
        self._states, end, generator_ends = self.tape.advance(*shared[:2], recorder.generators, shared[2])
        if not _same(shared, local):  # this rank drew from another stream: leave it where its own build would
            _, end, generator_ends = self.tape.advance(*local[:2], recorder.generators, local[2])
        torch.set_rng_state(end)
        for generator, state in zip(recorder.generators, generator_ends):
            generator.set_state(state)

    # -- after the block ----------------------------------------------------------------
    def alive(self) -> bool:
        """Whether any tensor registered in a module during the block is still referenced."""
        return any(ref() is not None for ref in self._tensors.values())

    def modules(self) -> list[torch.nn.Module]:
        """The modules that were given parameters or buffers in the block and still exist, in
        the order they were first given one (the same on every rank)."""
        return [m for m in (ref() for ref in self._modules.values()) if m is not None]

    def owns(self, tensor: torch.Tensor) -> bool:
        return self.tape.owns(tensor)

    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The full value ``tensor`` (built in the block) has in a plain build, on the CPU."""
        if not tensor.is_meta:
            return tensor.detach()
        states = None if self._states is None else self._states.__getitem__
        try:
            return self.tape.tensor_value(Ref.of(tensor), states)
        except NotReplayable as error:
            raise NotReplayable(_explain(str(error))) from None


def _to_cpu(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.cpu()
    if isinstance(data, (list, tuple)):
        return type(data)(_to_cpu(d) for d in data)
    return data


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b  # type: ignore[no-any-return]


def _explain(reason: str) -> str:
    return (
        f"lite.sharded_init() cannot give this model the values a plain build gives it: {reason}. "
        "Build it without sharded_init (`model = Net()` before lite.setup: every rank then holds "
        "the whole model until setup shards it), or build it with `lite.sharded_init(empty=True)` "
        "and load its weights afterwards (`lite.load_pretrained(model, path)` or `lite.load`)."
    )
