"""Which set-up models an open ``lite.join`` block holds, for their user methods to ask.

Inside ``lite.join`` a rank that has run out of data replays each forward of the models so
that it keeps taking part in their collectives; it cannot replay a user method (it does not
know one was called). A method must therefore neither gather parameters (FSDP, ZeRO-3) nor
have its result back-propagated there; user_model.py and fsdp/methods.py refuse both, and ask
here whether the model is in a join block.

The join session enters :func:`models_in_join` for its models (the user's modules, as
``strategy.unwrap`` gives them) for as long as it is open.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator

import torch

__all__ = ["in_join", "models_in_join", "refuse_backward_in_join", "refuse_gather_in_join"]

_joined: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "scopedlite.joined_models", default=frozenset()
)


@contextlib.contextmanager
def models_in_join(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """While open, :func:`in_join` is true for ``modules`` (the user's own modules)."""
    token = _joined.set(_joined.get() | {id(m) for m in modules})
    try:
        yield
    finally:
        _joined.reset(token)


def in_join(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a user's module of a set-up model) is in an open ``lite.join`` block."""
    return id(module) in _joined.get()


def refuse_gather_in_join(method: str) -> None:
    """Raise: ``method`` (``"GPT.generate"``) needs the parameters gathered inside ``lite.join``."""
    raise RuntimeError(
        f"Inside lite.join, {method}() needs the model's parameters gathered, which ranks "
        "that have run out of data cannot take part in (they replay the model's forward, not "
        "your methods). Call it outside the lite.join block, or do its work in forward."
    )


def refuse_backward_in_join(method: str, _: object = None) -> None:
    """Raise (on every rank that back-propagates ``method``'s result inside ``lite.join``)."""
    raise RuntimeError(
        f"Inside lite.join the result of the model's own method {method}() was back-propagated: "
        "ranks that run out of data replay the model's forward, not your methods, so they "
        "could not take part in this backward. Compute the loss in forward (`loss = "
        "model(x)`), or call the method outside the lite.join block."
    )
