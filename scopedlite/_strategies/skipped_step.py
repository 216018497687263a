"""The refusal for a step that some ranks skipped while the others took it, outside ``lite.join``.

Data-parallel backends reduce each gradient with whatever the other ranks send next on the
group, so a rank that skips a step (``if not torch.isfinite(loss): continue`` on one rank)
pairs its next backward with the others' current one. The ranks' numbers of training
forwards (gradients enabled) tell it: the skipping rank ran one more. DDP compares them in
its communication hook (``ddp/counted.py``), DeepSpeed in ``lite.backward``
(``deepspeed/counted.py``): each as one all-reduce of :func:`spread` under MAX, read with
:func:`ranges`, and both refuse with these messages. Where a forward gathers parameters
(fsdp, model_parallel, ZeRO-3) the skipping rank's next forward would meet the others'
backward first: the gather ledger (``lockstep.py``) refuses that forward with
:func:`forward_past_backward`.
"""

from __future__ import annotations

import torch

__all__ = ["different_forwards", "different_models", "forward_past_backward", "ranges", "spread"]

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


def forward_past_backward(forwards: int, since: int, elsewhere: dict[int, str], strategy: str) -> RuntimeError:
    """The error for this rank's training forward ``forwards`` (``since`` of them since its last
    backward) that the ranks in ``elsewhere`` do not run before their next backward (what each
    does instead), under a ``strategy`` whose forwards gather parameters."""
    others = "; ".join(f"rank {r} {done}" for r, done in sorted(elsewhere.items()))
    return RuntimeError(
        f"This rank is about to run training forward {forwards} of the set-up model(s) ({since} "
        f"since its last lite.backward), but the other ranks do not run it ({others}), under "
        f"strategy={strategy!r}, where a forward gathers parameters from every rank: its "
        "gathers would meet their backward's collectives and the run would hang. A rank skipped the "
        "backward of a step the others took (`if not torch.isfinite(loss): continue` on one "
        "rank), or ran a forward with gradients enabled that the others did not (an evaluation "
        f"without torch.no_grad()). {_DECIDE_TOGETHER}; evaluate under torch.no_grad() on every "
        "rank; or run the loop inside `with lite.join(model):`. The other ranks wait in their "
        "collectives, so this error ends the run."
    )
