"""Recording how a model is built, operation by operation, on the meta device.

Inside the recorder every tensor a factory (``torch.empty``, ``torch.randn``, ``arange``...)
would allocate is created on the meta device instead, and every operation that touches a
meta tensor is appended to a :class:`Tape` - the initialisers of ``__init__`` and those of a
later ``post_init()`` alike, in the order they ran. Nothing is allocated and no random number
is drawn. The tape is then enough to compute, later and one at a time, the exact value any
tensor of the model would have had in a plain build (``tensor_value``).

What the recorder does not defer:

- tensors made from data (``torch.tensor([...])``, ``torch.from_numpy``) are real already;
  when they meet a meta tensor, their value is kept on the tape as a constant;
- an operation that needs values (``.item()``, ``.tolist()``, data-dependent shapes) runs
  for real on the values its inputs would have, computed from the tape at once, as long as
  no random draw went into them;
- a random draw on a real tensor is refused: it would take its numbers from the middle of
  the model's stream and neither it nor the model would get a plain build's values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from scopedlite._core.structures import map_leaves
from scopedlite._private.torch_internals import OpInterceptor, op_facts, storage_key

__all__ = ["Const", "Entry", "NotReplayable", "Recorder", "Ref", "Tape"]

META = torch.device("meta")
CPU = torch.device("cpu")


class NotReplayable(RuntimeError):
    """Building the module inside ``sharded_init`` did something that cannot be replayed exactly."""


@dataclass(frozen=True)
class Ref:
    """A deferred tensor: a view (dtype, size, stride, offset) of one recorded storage."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Ref:
        return cls(
            storage_key(tensor), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
        )

    def matches(self, tensor: torch.Tensor) -> bool:
        return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()) == (
            self.dtype,
            self.size,
            self.stride,
            self.offset,
        )

    def view(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclass(frozen=True)
class Const:
    """A real tensor that met a deferred one: its value, kept on the CPU."""

    value: torch.Tensor


@dataclass
class Entry:
    """One recorded operation: its arguments (tensors as :class:`Ref` or :class:`Const`), the
    tensors it returned, the storages it read, wrote and created, and what replaying needs."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[Ref | None]
    reads: frozenset[int]
    writes: frozenset[int]
    creates: frozenset[int]
    random: bool
    generator: torch.Generator | None  # an explicit generator argument (CPU), else None
    default_dtype: torch.dtype  # promotion of Python numbers depends on it


def _leaves(data: Any) -> list[Any]:
    found: list[Any] = []
    map_leaves(data, found.append, lambda x: isinstance(x, (torch.Tensor, Ref, Const)))
    return found


def _with_device(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (device if k == "device" else v) for k, v in kwargs.items()}


class Tape:
    """The recorded operations of one build and the storages they made."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.storages: dict[int, torch.UntypedStorage] = {}  # kept alive: keys are addresses
        self._writers: dict[int, list[int]] = {}

    def append(self, entry: Entry) -> None:
        for key in entry.writes:
            self._writers.setdefault(key, []).append(len(self.entries))
        self.entries.append(entry)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.is_meta and storage_key(tensor) in self.storages

    # -- computing values -----------------------------------------------------------------
    def needed(self, keys: set[int], before: int | None = None) -> list[int]:
        """The entries (ascending) that the values of the storages ``keys`` depend on, as they
        are before entry ``before`` (default: after the whole build)."""
        limit = len(self.entries) if before is None else before
        latest: dict[int, int] = {}
        todo = [(key, limit) for key in keys]
        chosen: set[int] = set()
        while todo:
            key, until = todo.pop()
            if latest.get(key, -1) >= until:
                continue
            done = latest.get(key, -1)
            latest[key] = until
            for index in self._writers.get(key, ()):
                if done <= index < until and index not in chosen:
                    chosen.add(index)
                    todo.extend((read, index) for read in self.entries[index].reads)
        return sorted(chosen)

    def run(
        self, indices: list[int], states: Callable[[int], Any] | None, scratch: bool = False
    ) -> dict[int, torch.UntypedStorage]:
        """Execute ``indices`` in order on the CPU and return the storages they filled.

        ``states(i)`` gives the generator state random entry ``i`` starts from (None: skip the
        random entries, as ``sharded_init(empty=True)`` does). ``scratch``: storages the
        entries did not create are allocated (uninitialised) instead of required.
        """
        real: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for index in indices:
                entry = self.entries[index]
                generator = None
                if entry.random:
                    if states is None:
                        continue
                    if entry.generator is None:
                        torch.set_rng_state(states(index))
                    else:
                        generator = torch.Generator()
                        generator.set_state(states(index))
                self._execute(entry, real, scratch, generator)
        return real

    def advance(
        self,
        start: torch.Tensor,
        reseeds: list[tuple[int, torch.Tensor]],
        generators: list[torch.Generator],
        generator_starts: list[torch.Tensor],
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """Draw every random entry in order, as a plain build would, on scratch tensors of the
        right layout (one at a time): the state each entry starts from, and the states of the
        global generator and of each explicit one after the build."""
        states: dict[int, torch.Tensor] = {}
        clones = []
        for state in generator_starts:
            clone = torch.Generator()
            clone.set_state(state)
            clones.append(clone)
        pending = list(reseeds)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(start)
            for index in self.random_entries():
                while pending and pending[0][0] <= index:
                    torch.set_rng_state(pending.pop(0)[1])
                entry = self.entries[index]
                generator = None
                if entry.generator is not None:
                    generator = clones[next(j for j, g in enumerate(generators) if g is entry.generator)]
                states[index] = generator.get_state() if generator is not None else torch.get_rng_state()
                self._execute(entry, {}, True, generator)
            for _, state in pending:
                torch.set_rng_state(state)
            end = torch.get_rng_state()
        return states, end, [clone.get_state() for clone in clones]

    def _execute(
        self, entry: Entry, real: dict[int, torch.UntypedStorage], scratch: bool, generator: torch.Generator | None
    ) -> None:
        def value(leaf: Any) -> Any:
            if isinstance(leaf, Const):
                return leaf.value
            if leaf.key not in real:
                if not scratch:
                    raise NotReplayable(f"{entry.func} reads a tensor whose value was not computed")
                real[leaf.key] = torch.empty(self.storages[leaf.key].nbytes(), dtype=torch.uint8).untyped_storage()
            return leaf.view(real[leaf.key])

        def is_leaf(x: Any) -> bool:
            return isinstance(x, (Ref, Const))

        args = map_leaves(entry.args, value, is_leaf)
        kwargs = _with_device(map_leaves(entry.kwargs, value, is_leaf), CPU)
        if generator is not None:
            kwargs["generator"] = generator
        previous = torch.get_default_dtype()
        torch.set_default_dtype(entry.default_dtype)
        try:
            out = entry.func(*args, **kwargs)
        finally:
            torch.set_default_dtype(previous)
        for tensor, ref in zip(_leaves(out), entry.outputs):
            if ref is not None and ref.key in entry.creates:
                if not ref.matches(tensor):
                    raise NotReplayable(
                        f"{entry.func} gives a tensor laid out differently on the CPU than on the "
                        "meta device, so its value cannot be recomputed exactly"
                    )
                real[ref.key] = tensor.untyped_storage()

    def tensor_value(self, ref: Ref, states: Callable[[int], Any] | None) -> torch.Tensor:
        """The full value of the recorded tensor ``ref``, computed on the CPU from the entries
        it depends on only (one parameter and its temporaries at a time)."""
        real = self.run(self.needed({ref.key}), states)
        if ref.key not in real:
            raise NotReplayable("a tensor of the module was never written while it was built")
        return ref.view(real[ref.key])

    def random_entries(self) -> Iterator[int]:
        return (i for i, e in enumerate(self.entries) if e.random)


class Recorder(OpInterceptor):
    """The dispatch mode that fills a :class:`Tape` (see the module docstring).

    Attributes:
        tape: What was recorded.
        reseeds: ``(entry index, state)`` wherever the global CPU generator was set while
            recording (``torch.manual_seed`` inside the block): the plain build's stream
            restarts there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tape = Tape()
        self.reseeds: list[tuple[int, torch.Tensor]] = []
        self.generators: list[torch.Generator] = []  # explicit generators, in first-use order
        self.generator_starts: list[torch.Tensor] = []  # their states at first use
        self.start_state = torch.get_rng_state()
        self._last_state = self.start_state

    def begin(self) -> None:
        """The block starts: the global generator's stream starts here."""
        self.start_state = self._last_state = torch.get_rng_state()

    def note_generator(self) -> None:
        """Remember where the global generator is now if something outside the tape set it."""
        state = torch.get_rng_state()
        if not torch.equal(state, self._last_state):
            self.reseeds.append((len(self.tape.entries), state))
            self._last_state = state

    def intercept(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        facts = op_facts(func)
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if facts.factory:
            kwargs = {**kwargs, "device": META}
        elif not any(t.is_meta for t in tensors):
            if facts.random:
                raise NotReplayable(
                    f"{func} draws random numbers into a tensor that is not deferred (made from "
                    "data, or on a device given explicitly)"
                )
            out = func(*args, **kwargs)
            if not any(isinstance(t, torch.Tensor) and t.is_meta for t in _leaves(out)):
                return out  # nothing deferred in or out: not part of the model's build
        foreign = [t for t in tensors if t.is_meta and storage_key(t) not in self.tape.storages]
        if foreign:
            raise NotReplayable(
                f"{func} uses a tensor on the meta device that was made outside lite.sharded_init(), "
                "whose value is unknown"
            )
        if "device" in kwargs:  # a deferred tensor stays deferred, wherever it was sent
            kwargs = _with_device(kwargs, META)
        try:
            return self._record(func, facts, args, kwargs)
        except NotReplayable:
            raise
        except (NotImplementedError, RuntimeError) as error:
            if not any(t.is_meta for t in tensors):
                raise
            return self._compute_now(func, args, kwargs, error)

    def _record(self, func: Any, facts: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if facts.random:
            self.note_generator()

        def is_leaf(x: Any) -> bool:
            return isinstance(x, torch.Tensor)

        def as_recorded(t: torch.Tensor) -> Any:
            return Ref.of(t) if t.is_meta else Const(t.detach().to(CPU, copy=True))

        def as_meta(t: torch.Tensor) -> torch.Tensor:
            return t if t.is_meta else t.to(META)

        recorded_args = map_leaves(args, as_recorded, is_leaf)
        recorded_kwargs = map_leaves(kwargs, as_recorded, is_leaf)
        generator = recorded_kwargs.pop("generator", None)
        if generator is not None:
            if generator.device.type != "cpu":
                raise NotReplayable(f"{func} draws from a {generator.device.type} generator")
            if not any(g is generator for g in self.generators):
                self.generators.append(generator)
                self.generator_starts.append(generator.get_state())
        out = func(*map_leaves(args, as_meta, is_leaf), **map_leaves(kwargs, as_meta, is_leaf))
        outputs: list[Ref | None] = []
        creates: set[int] = set()
        for tensor in _leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                key = storage_key(tensor)
                if key not in self.tape.storages:
                    self.tape.storages[key] = tensor.untyped_storage()
                    creates.add(key)
                outputs.append(Ref.of(tensor))
            else:
                outputs.append(None)
        flat_args = list(args)
        written = set(creates)
        for position, name in facts.written:
            target = flat_args[position] if position < len(flat_args) else kwargs.get(name)
            written.update(storage_key(t) for t in _leaves(target) if isinstance(t, torch.Tensor) and t.is_meta)
        reads = {leaf.key for leaf in _leaves((recorded_args, recorded_kwargs)) if isinstance(leaf, Ref)}
        self.tape.append(
            Entry(
                func=func,
                args=recorded_args,
                kwargs=recorded_kwargs,
                outputs=outputs,
                reads=frozenset(reads),
                writes=frozenset(written),
                creates=frozenset(creates),
                random=facts.random,
                generator=generator,
                default_dtype=torch.get_default_dtype(),
            )
        )
        return out

    def _compute_now(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], error: BaseException) -> Any:
        """An operation that needs values: compute its deferred inputs now (see the module
        docstring) and run it for real. What it returns is a constant from here on."""
        keys = {storage_key(t) for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta}
        indices = self.tape.needed(keys)
        if any(self.tape.entries[i].random for i in indices):
            raise NotReplayable(
                f"{func} needs the values of a tensor drawn at random while the module is built, "
                "which are only known once the whole build is replayed"
            ) from error
        real = self.tape.run(indices, None)

        def is_tensor(x: Any) -> bool:
            return isinstance(x, torch.Tensor)

        convert = functools.partial(_materialised, real)
        kwargs = map_leaves(kwargs, convert, is_tensor)
        return func(
            *map_leaves(args, convert, is_tensor), **(_with_device(kwargs, CPU) if "device" in kwargs else kwargs)
        )


def _materialised(real: dict[int, torch.UntypedStorage], tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_meta:
        return tensor
    return Ref.of(tensor).view(real[storage_key(tensor)])
