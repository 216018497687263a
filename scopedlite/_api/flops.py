"""``lite.measure_flops``: what a step costs, in FLOPs.

``measure_flops`` counts with torch's own ``torch.utils.flop_counter.FlopCounterMode``, as
Lightning Fabric's function of the same name does: every matrix multiplication, convolution
and attention kernel of the call, forward and (with a loss function) backward; elementwise
operations count nothing, as in the usual "6 N" estimates. A module of its own because
importing torch's counter takes seconds, which ``lite.throughput`` does not need to pay; it is
imported at the first call, so resolving ``lite.measure_flops`` does not pay it either.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from scopedlite._private.torch_internals import cpu_attention_ops

__all__ = ["measure_flops"]


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    """Scaled dot-product attention forward: ``Q @ K^T`` and ``P @ V``, full (not causal)
    score matrices, as torch counts its CUDA kernels."""
    *batch, queries, head_dim = query_shape
    keys, value_dim = key_shape[-2], value_shape[-1]
    return 2 * torch.Size(batch).numel() * queries * keys * (head_dim + value_dim)


def _attention_backward_flops(
    grad_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    """Its backward: the gradients of the scores, of V, of Q and of K, twice the forward."""
    return 2 * _attention_flops(query_shape, key_shape, value_shape)


# torch 2.13's FlopCounterMode knows the CUDA attention kernels but not the one
# F.scaled_dot_product_attention runs on CPU tensors, which it would count as 0.
_CPU_ATTENTION = dict(zip(cpu_attention_ops(), (_attention_flops, _attention_backward_flops)))


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> int:
    """The FLOPs of ``forward_fn()`` (and of the backward of ``loss_fn(output)``, if given).

    Counted by ``torch.utils.flop_counter.FlopCounterMode``: a ``Linear`` of ``i`` inputs
    and ``o`` outputs on ``n`` rows counts ``2 * n * i * o`` forward, twice that backward
    (the input's and the weight's gradients; the first layer's input needs none); attention
    (``F.scaled_dot_product_attention``) counts its full score matrix, causal or not, also
    on CPU tensors, which torch's counter alone leaves out. Build the
    model on the meta device to count without computing anything and without any
    collective (``with torch.device("meta"): model = Net()``, and meta inputs); a model
    returned by ``lite.setup`` really runs, so call it on every rank. The gradients of
    ``model``'s parameters are left as they were (the backward's are dropped).

    Args:
        model: The model ``forward_fn`` runs; its gradients are kept.
        forward_fn: Runs one forward, e.g. ``lambda: model(x)``.
        loss_fn: Turns the forward's output into a scalar loss, whose backward is counted
            too, e.g. ``lambda y: y.sum()``; None counts the forward only.

    Returns:
        The number of floating-point operations (a multiply-add counts 2).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"lite.measure_flops(model={model!r}): model must be a torch.nn.Module.")
    if not callable(forward_fn) or (loss_fn is not None and not callable(loss_fn)):
        raise TypeError(
            "lite.measure_flops(model, forward_fn, loss_fn=None): forward_fn must be a callable "
            "without arguments and loss_fn a callable of the output, e.g. "
            "`lite.measure_flops(model, lambda: model(x), lambda y: y.sum())`."
        )
    saved = [(p, p.grad) for p in model.parameters()]
    for parameter, _ in saved:
        parameter.grad = None  # the backward would add to these in place
    from torch.utils.flop_counter import FlopCounterMode  # lazy: loads torch's op tables (and triton's stubs)

    counter = FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)
    try:
        with counter:
            output = forward_fn()
            if loss_fn is not None:
                loss_fn(output).backward()
    finally:
        for parameter, grad in saved:
            parameter.grad = grad
    return int(counter.get_total_flops())
