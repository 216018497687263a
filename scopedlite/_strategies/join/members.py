"""Whether a ``lite.join`` block is open in this context, and which set-up models it holds.

One question, :func:`in_join`, asked two ways. Without a module: is a block open here (the
sampler of ``setup_dataloader`` neither pads nor drops inside one, ``lite.save`` and a
loader's state are refused there). With a user's module: is it one of the block's models -
inside ``lite.join`` a rank that has run out of data replays each forward of the models so
that it keeps taking part in their collectives; it cannot replay a user method (it does not
know one was called), so a method must neither gather parameters (FSDP, ZeRO-3) nor have its
result back-propagated there; user_model.py and fsdp/methods.py refuse both.

The join session (``session.py``) enters :func:`join_block` with its models (the user's
modules, as ``strategy.unwrap`` gives them) for as long as it is open; a one-process
strategy's session with none.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator

import torch

__all__ = ["in_join", "join_block", "refuse_backward_in_join", "refuse_gather_in_join"]

# The ids of the open block's models; None while no block is open in this context.
_block: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("scopedlite.join_block", default=None)


@contextlib.contextmanager
def join_block(modules: Iterable[torch.nn.Module] = ()) -> Iterator[None]:
    """While open, a ``lite.join`` block is open in this context, holding ``modules``."""
    token = _block.set(frozenset(id(m) for m in modules))
    try:
        yield
    finally:
        _block.reset(token)


def in_join(module: torch.nn.Module | None = None) -> bool:
    """Whether a ``lite.join`` block is open in this context; given a user's module of a
    set-up model, whether it is one of that block's models."""
    block = _block.get()
    return block is not None and (module is None or id(module) in block)


def refuse_gather_in_join(
    method: str, fix: str = "Call it outside the lite.join block, or do its work in forward."
) -> None:
    """Raise: ``method`` (``"GPT.generate"``) needs the parameters gathered inside ``lite.join``."""
    raise RuntimeError(
        f"Inside lite.join, {method}() needs the model's parameters gathered, which ranks "
        "that have run out of data cannot take part in (they replay the model's forward, not "
        f"your methods). {fix}"
    )


def refuse_backward_in_join(method: str, _: object = None) -> None:
    """Raise (on every rank that back-propagates ``method``'s result inside ``lite.join``)."""
    raise RuntimeError(
        f"Inside lite.join the result of the model's own method {method}() was back-propagated: "
        "ranks that run out of data replay the model's forward, not your methods, so they "
        "could not take part in this backward. Compute the loss in forward (`loss = "
        "model(x)`), or call the method outside the lite.join block."
    )
