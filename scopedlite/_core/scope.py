"""The one mechanism every scope of scopedlite is built on.

A kind of scope whose active instance other code must find (``launch``, ``join``) keeps it
in a private :class:`contextvars.ContextVar`; entering sets it and keeps the token, exiting
resets it. ``ContextVar.reset`` does not notice
scopes exited out of order, so every scope also records itself in one chain of open scopes
(``_open``) and checks on exit that it is the innermost one. A scope object is good for one
``with`` block only: entering it twice, nested or one after the other, is refused, because a
second entry would overwrite the token of the first (the same trap as ``torch.autocast``).
"""

from __future__ import annotations

import contextvars
import functools
from types import TracebackType
from typing import Any, Callable, ClassVar, ContextManager, Generic, TypeVar

__all__ = ["Scope", "ScopeError", "WrapperScope", "carry", "open_scopes"]

_T = TypeVar("_T")
_R = TypeVar("_R")

# The chain of scopes open in this context, outermost first. Immutable tuples, so a copied
# context (a thread started through `carry`) extends its own chain without touching ours.
_open: contextvars.ContextVar[tuple[Scope[Any], ...]] = contextvars.ContextVar("scopedlite.open_scopes", default=())


class ScopeError(RuntimeError):
    """A scope was used in a way that would corrupt the chain of active scopes."""


def open_scopes() -> tuple[Scope[Any], ...]:
    """Return the scopes open in the current context, outermost first."""
    return _open.get()


class Scope(Generic[_T]):
    """Base of every context manager of scopedlite.

    Subclasses implement :meth:`_enter` and :meth:`_exit`, and set ``_var`` (one
    ``ContextVar`` per kind of scope) when other code reads the active instance. The base
    keeps the bookkeeping that makes misuse loud.
    """

    _var: ClassVar[contextvars.ContextVar[Any] | None] = None
    _state: str = "new"  # new -> open -> closed

    def _enter(self) -> _T:
        raise NotImplementedError

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return None

    def describe(self) -> str:
        """A short name for error messages, e.g. ``lite.autocast('bf16-mixed')``."""
        return type(self).__name__

    def __enter__(self) -> _T:
        if self._state != "new":
            raise ScopeError(
                f"{self.describe()} was already entered once; a scope object is good for one "
                "`with` block only. Create a new one for each block, e.g. "
                "`with lite.autocast(): ...` instead of reusing a stored scope."
            )
        value = self._enter()
        # Only a scope that entered successfully becomes active: a failed `_enter` leaves the
        # context untouched, so there is nothing to undo.
        self._token = self._var.set(self) if self._var is not None else None
        _open.set((*_open.get(), self))
        self._state = "open"
        return value

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        chain = _open.get()
        misnested = not chain or chain[-1] is not self
        self._state = "closed"
        # Cleanup runs even when misnested: leaving processes or process groups behind
        # would be worse than the nesting error itself.
        try:
            suppress = self._exit(exc_type, exc, tb)
        finally:
            if self._var is not None and self._var.get() is self:
                self._var.reset(self._token)
            # Rebuild the chain rather than resetting to the token: after a misnested exit,
            # the scope that closed too early must not come back when its inner scope exits.
            _open.set(tuple(s for s in _open.get() if s is not self and s._state == "open"))
        if misnested:
            inner = [s.describe() for s in chain[chain.index(self) + 1 :]] if self in chain else []
            still = ", ".join(inner) if inner else "a scope from another context"
            raise ScopeError(
                f"{self.describe()} exited while {still} is still open inside it: scopes must "
                "close in the reverse order they opened. With contextlib.ExitStack, close the "
                "stack as a whole instead of closing an outer scope by hand."
            )
        return suppress


class WrapperScope(Scope[_T]):
    """A scope whose work is another context manager's, chosen when the block opens (the
    strategy's join session or init context, torch's autocast region, ...)."""

    def _inner_context(self) -> tuple[ContextManager[Any], _T]:
        """The context manager to run the block in, and the value ``with ... as`` gets."""
        raise NotImplementedError

    def _enter(self) -> _T:
        self._inner, value = self._inner_context()
        self._inner.__enter__()
        return value

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        # The inner context decides nothing about the exception: it always propagates.
        self._inner.__exit__(exc_type, exc, tb)
        return None


def carry(fn: Callable[..., _R]) -> Callable[..., _R]:
    """Wrap ``fn`` so it runs inside a copy of the scopes active now.

    Threads (and executors) start with no scope: code in them sees the default one-process
    run, because sending a thread into a collective by accident deadlocks the world. Carry the
    scopes across on purpose when a helper thread must find the run::

        with lite.launch(strategy="ddp", devices=2):
            threading.Thread(target=lite.carry(upload_metrics)).start()

    The wrapped callable may be called several times, each time in a fresh copy of the
    context captured when ``carry`` was called.
    """
    context = contextvars.copy_context()

    @functools.wraps(fn)
    def run_in_copy(*args: Any, **kwargs: Any) -> _R:
        return context.copy().run(fn, *args, **kwargs)

    return run_in_copy
