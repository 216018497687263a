"""Numbers read from sharded values are their whole values, on 2 ranks; rank 0 writes them.

Every rank builds the plain model too (the reference, plain torch) and the set-up one, takes
one step on the same global batch, and reads numbers from the sharded parameters and
gradients as a one-device script does: float(), .item(), .tolist(), int(), bool(), an
f-string, and the norm torch.nn.utils.clip_grad_norm_ returns (nanoGPT logs it). Then rank 0
alone reads a norm, clips with torch's clip_grad_norm_, gathers a whole parameter
(full_tensor()) and clips with lite.clip_gradients (each refused at once, and the run goes on),
and every rank reads a norm inside lite.join (refused on every rank).

argv: strategy (fsdp | model_parallel: tensor parallel over both ranks)
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, write

name = sys.argv[1]
if name == "model_parallel":
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def parallelize(model, mesh):
        parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model

    strategy = lite.ModelParallelStrategy(parallelize, data_parallel=1, tensor_parallel=2)
else:
    strategy = name


def reads(model, norm):
    """What a script reads from the parameters, the gradients and a gradient norm."""
    first, second = list(model.parameters())[:2]
    return {
        "float_norms": [float(p.detach().norm()) for p in model.parameters()],
        "item_sums": [p.detach().sum().item() for p in model.parameters()],
        "grad_norms": [float(p.grad.norm()) for p in model.parameters()],
        "tolist": second.detach().tolist(),
        "int_positive": int((first.detach() > 0).sum()),
        "bool_any_big": bool((first.detach().abs() > 0.5).any()),
        "f_string": f"{first.detach().norm():.6f}",
        "clip_norm": float(norm),
        "clip_norm_item": norm.item(),
    }


def step(model, x, y, backward):
    """One backward of the mean squared error, then the gradients clipped as nanoGPT does."""
    backward(torch.nn.functional.mse_loss(model(x), y))
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)


g = torch.Generator().manual_seed(3)
X, Y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    reference = make_model()  # plain torch: the whole batch, one process's numbers
    expected = reads(reference, step(reference, X, Y, torch.Tensor.backward))
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    share, shares = run.data_parallel_rank, run.data_parallel_size  # fsdp: halves; tensor parallel: all
    got = reads(model, step(model, X[share::shares], Y[share::shares], lite.backward))
    alone = None
    if run.is_global_zero:
        try:
            float(next(model.parameters()).detach().norm())  # a log line on rank 0 only
        except lite.MethodCalledOnSomeRanksError as e:
            alone = str(e)
    lite.barrier()  # the run goes on
    # Rank 0 alone starts a collective over DTensors (a clip that logs the norm, a whole
    # parameter) or clips with lite.clip_gradients: refused at once, and the run goes on.
    others_alone = {}
    for what, call in (
        ("torch_clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)),
        ("full_tensor", lambda: next(model.parameters()).full_tensor()),
        ("lite_clip", lambda: lite.clip_gradients(model, opt, max_norm=1.0)),
    ):
        if run.is_global_zero:
            try:
                call()
            except lite.MethodCalledOnSomeRanksError as e:
                others_alone[what] = str(e)
        lite.barrier()
    after = float(next(model.parameters()).detach().norm())  # in step again: read together
    in_join = None
    with lite.join(model):
        try:
            float(next(model.parameters()).detach().norm())
        except RuntimeError as e:
            in_join = str(e)
    out = from_every_rank(
        {
            "expected": expected,
            "got": got,
            "alone": alone,
            "others_alone": others_alone,
            "after": after,
            "in_join": in_join,
            "sharded": [type(p).__name__ for p in model.parameters()],
        }
    )
from torch.distributed.tensor import DTensor  # noqa: E402 - imported by the run already

reads_of_dtensor = ("item", "tolist", "__float__", "__int__", "__bool__", "__format__")
if lite.current().is_global_zero:  # the process that ran rank 0, after its block
    out[0]["restored"] = not any(name in vars(DTensor) for name in reads_of_dtensor)
    write(out)
