"""The refusal for a step that some ranks skipped while the others took it, outside ``lite.join``.

Data-parallel backends reduce each gradient with whatever the other ranks send next on the
group, so a rank that skips a step (``if not torch.isfinite(loss): continue`` on one rank)
pairs its next backward with the others' current one. The ranks' numbers of training
forwards (gradients enabled) tell it: the skipping rank ran one more. DDP compares them in
its communication hook (``ddp/counted.py``), DeepSpeed in ``lite.backward``
(``deepspeed/counted.py``): each as one all-reduce of :func:`spread` under MAX, read with
:func:`ranges`, and both refuse with these messages.
"""

from __future__ import annotations

import torch

__all__ = ["different_forwards", "different_models", "ranges", "spread"]

_DECIDE_TOGETHER = (
    'Decide a skip on every rank together: `skip = lite.all_reduce(float(not torch.isfinite(loss)), op="max") '
    "> 0`, then `continue` everywhere"
)


def spread(*values: int) -> torch.Tensor:
    """``[v, -v]`` for each of ``values``: all-reduced under MAX, ``[most, -least]`` over the ranks."""
    return torch.tensor([x for v in values for x in (v, -v)], dtype=torch.int64)


def ranges(reduced: torch.Tensor) -> list[tuple[int, int]]:
    """``(least, most)`` over the ranks of each value of an all-reduced :func:`spread`."""
    return [(-negated, most) for most, negated in reduced.view(-1, 2).tolist()]


def different_forwards(mine: int, least: int, most: int, harm: str) -> RuntimeError:
    """The error for ranks that reached a backward after ``least``..``most`` training forwards
    (this rank ``mine``); ``harm``: what the backend would have done with the gradients."""
    return RuntimeError(
        f"The ranks reached this backward after different numbers of training forwards of "
        f"the model (this rank {mine}; between {least} and {most} across ranks), so {harm}: "
        "a rank skipped a step the others took (`if not torch.isfinite(loss): continue` on "
        "one rank), or ran a forward with gradients enabled that the others did not (an "
        f"evaluation without torch.no_grad()). {_DECIDE_TOGETHER}; evaluate under "
        "torch.no_grad(); or run the loop inside `with lite.join(model):`."
    )


def different_models(least: int, most: int) -> RuntimeError:
    """The error for ranks whose ``lite.backward`` here trains models of setup places
    ``least``..``most`` (DeepSpeed: one engine per model)."""
    return RuntimeError(
        f"The ranks ran lite.backward on different models here (setup places {least} to "
        f"{most}), so DeepSpeed would reduce gradients of different models together: a rank "
        f"skipped a backward the others ran. {_DECIDE_TOGETHER}; or run the loop inside "
        "`with lite.join(model):`."
    )
