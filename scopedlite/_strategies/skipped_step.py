"""The refusal for a step that some ranks skipped while the others took it, outside ``lite.join``.

Data-parallel backends reduce each gradient with whatever the other ranks send next on the
group, so a rank that skips a step (``if not torch.isfinite(loss): continue`` on one rank)
pairs its next backward with the others' current one. The ranks' numbers of training
forwards (gradients enabled) tell it: the skipping rank ran one more. DDP compares them in
its communication hook (``ddp/counted.py``), DeepSpeed in ``lite.backward``
(``deepspeed/counted.py``); both refuse with this message.
"""

from __future__ import annotations

__all__ = ["different_forwards"]


def different_forwards(mine: int, least: int, most: int, harm: str) -> RuntimeError:
    """The error for ranks that reached a backward after ``least``..``most`` training forwards
    (this rank ``mine``); ``harm``: what the backend would have done with the gradients."""
    return RuntimeError(
        f"The ranks reached this backward after different numbers of training forwards of "
        f"the model (this rank {mine}; between {least} and {most} across ranks), so {harm}: "
        "a rank skipped a step the others took (`if not torch.isfinite(loss): continue` on "
        "one rank), or ran a forward with gradients enabled that the others did not (an "
        "evaluation without torch.no_grad()). Decide a skip on every rank together: `skip = "
        'lite.all_reduce(float(not torch.isfinite(loss)), op="max") > 0`, then `continue` '
        "everywhere; evaluate under torch.no_grad(); or run the loop inside "
        "`with lite.join(model):`."
    )
