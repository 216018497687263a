"""Train with the DDP user's lines under FSDP, on 2 real gloo ranks.

argv: strategy (fsdp | fsdp_full_wrapped), optimizer (sgd | adamw),
sharded_init (0 | 1), checkpoint path, precision (default "32-true"). Rank 0 writes what the test compares.
"""

import sys

import torch

import scopedlite as lite
from _common import write
from _fsdp_common import make_data, make_net, make_optimizer, probe, train

kind, opt_kind, sharded, ckpt = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
strategy = {
    "fsdp": "fsdp",
    # every Linear its own FSDP unit with activations recomputed; one full checkpoint file
    "fsdp_full_wrapped": lite.FSDPStrategy(
        state_dict_type="full",
        auto_wrap_policy={torch.nn.Linear},
        activation_checkpointing={torch.nn.Linear},
        reshard_after_forward=False,
    ),
}[kind]
precision = sys.argv[5] if len(sys.argv) > 5 else "32-true"


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def params(model: torch.nn.Module) -> list[list[float]]:
    return [full(p).detach().flatten().tolist() for p in model.parameters()]


with lite.launch(strategy=strategy, devices=2, accelerator="cpu", precision=precision, timeout=60) as run:
    out = {}
    # rank 1 draws other values on purpose: every rank must end up with rank 0's, as under DDP
    lite.seed_everything(0 if run.global_rank == 0 else 7)
    if sharded:
        with lite.sharded_init():
            model = make_net()
        out["meta_after_init"] = all(p.is_meta for p in model.parameters())
    else:
        model = make_net()
    if kind == "fsdp_full_wrapped":  # the other order: model first, optimizer on its shards
        model = lite.setup_module(model)
        opt = lite.setup_optimizers(make_optimizer(opt_kind, model.parameters()))
    else:
        model, opt = lite.setup(model, make_optimizer(opt_kind, model.parameters()))  # the DDP line
    out["rng_after_setup"] = torch.rand(1).item()  # the generator moved on as after a plain build
    unwrapped = lite.current().strategy.unwrap(model)
    out["initial"] = params(unwrapped)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    out["local_numel"] = lite.all_gather(torch.tensor(sum(t.numel() for t in local))).tolist()
    out["local_bytes"] = lite.all_gather(torch.tensor(sum(t.untyped_storage().nbytes() for t in local))).tolist()
    out["total_numel"] = sum(full(p).numel() for p in model.parameters())
    out["opt_points_at_model"] = all(
        any(q is p for q in model.parameters()) for g in opt.param_groups for p in g["params"]
    )
    out["opt_lr"] = opt.param_groups[0]["lr"]

    x, y = make_data()
    rank = run.global_rank
    out["norm"] = train(
        model,
        opt,
        lambda s: (x[s][rank::2], y[s][rank::2]),
        lite.backward,
        lambda enabled: lite.no_backward_sync(model, enabled=enabled),
        lambda: (
            out.update(  # the whole gradient's inf- and 1-norms, not this rank's shard's (no-op clips)
                norm_inf=float(lite.clip_gradients(model, opt, max_norm=1e9, norm_type=float("inf"))),
                norm_1=float(lite.clip_gradients(model, opt, max_norm=1e9, norm_type=1)),
            ),
            lite.clip_gradients(model, opt, max_norm=0.05),
        )[1],
    )
    out["params"] = params(unwrapped)
    # what each rank holds itself: under FSDP its dim-0 chunk of every parameter
    mine = [(p.to_local() if hasattr(p, "to_local") else p).detach().flatten().tolist() for p in unwrapped.parameters()]
    out["local_params"] = [lite.broadcast(mine, src=r) for r in range(run.world_size)]

    class Bare(torch.nn.Module):  # initialises in __init__, has no reset_parameters()
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))

    torch.manual_seed(5)
    with lite.sharded_init():
        bare = Bare()
    out["bare"] = full(lite.setup(bare).w).tolist()

    class Peeks(torch.nn.Module):  # reads its own random values while it is built
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))
            self.positive = bool(self.w.sum() > 0)

    try:
        with lite.sharded_init():
            Peeks()
        out["peek_error"] = None
    except RuntimeError as e:
        out["peek_error"] = str(e)

    try:  # join takes the models set up in this run, never a plain module
        with lite.join(make_net()):
            pass
        out["join_error"] = None
    except TypeError as e:
        out["join_error"] = str(e)

    # save -> step on -> load restores outputs exactly, and the optimizer state too
    with torch.no_grad():
        out["probe_at_save"] = model(probe()).flatten().tolist()
    lite.save(ckpt, {"model": model, "opt": opt, "step": 4})

    def one_more_step() -> list[float]:
        xs, ys = x[-8:][rank::2], y[-8:][rank::2]
        out = model(xs)
        lite.backward(torch.nn.functional.mse_loss(out, ys.to(out.dtype)))  # one dtype: torch < 2.12
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            return model(probe()).flatten().tolist()

    out["probe_after_step"] = one_more_step()
    state = {"model": model, "opt": opt, "step": 0}
    out["rest"] = lite.load(ckpt, state)
    out["step"] = state["step"]
    with torch.no_grad():
        out["probe_after_load"] = model(probe()).flatten().tolist()
    out["probe_after_step_again"] = one_more_step()
    with torch.no_grad():
        out["output_dtype"] = str(model(probe()).dtype)
    out["param_dtype"] = str(next(model.parameters()).dtype)
    if run.is_global_zero:
        write(out)
