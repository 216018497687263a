"""Under fsdp, a state dict torch.save'd by rank 0 alone and loaded on every rank (the DDP way
to resume) is refused on the rank it would mislead; one file per rank loads back exactly.
The model's state dict and the optimizer's (Adam's exp_avg shards) alike.

Before, every rank loaded rank 0's shard into its own place, silently: the parameters (and
the optimizer's moments) came out wrong on every rank.
"""

import io

import torch

import scopedlite as lite
from _common import from_every_rank, full_params, make_model, write


def moments(opt):
    """Adam's exp_avg of each parameter, whole (every rank calls it)."""
    return [opt.state[p]["exp_avg"].full_tensor().flatten().tolist() for p in opt.param_groups[0]["params"]]


def rank_zero_file(state):
    """``state`` as rank 0 alone wrote it, read by every rank (as from a shared file system)."""
    blob = [None]
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        blob = [buffer.getvalue()]
    return torch.load(io.BytesIO(lite.broadcast(blob, src=0)[0]))


def fresh(seed):
    net = make_model(seed=seed)
    return lite.setup(net, torch.optim.Adam(net.parameters(), lr=0.1))


def stepped(model, opt):
    """One step, so that the optimizer holds state (the step's gradient differs per seed)."""
    lite.backward(model(torch.ones(4, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()


with lite.launch(strategy="fsdp", devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    model, opt = fresh(0)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    lite.backward(model(x).pow(2).mean())
    opt.step()
    trained, trained_moments = full_params(model), moments(opt)

    # rank 0 alone writes the file; every rank reads it into a fresh set-up model and optimizer
    model_file, opt_file = rank_zero_file(model.state_dict()), rank_zero_file(opt.state_dict())
    model2, opt2 = fresh(5)
    stepped(model2, opt2)
    errors = {}
    for name, target, state in (("model", model2, model_file), ("optimizer", opt2, opt_file)):
        try:
            target.load_state_dict(state)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)

    # one file per rank, each loading its own: exact
    own, own_opt = io.BytesIO(), io.BytesIO()
    torch.save(model.state_dict(), own)
    torch.save(opt.state_dict(), own_opt)
    model3, opt3 = fresh(6)
    stepped(model3, opt3)
    model3.load_state_dict(torch.load(io.BytesIO(own.getvalue())))
    opt3.load_state_dict(torch.load(io.BytesIO(own_opt.getvalue())))
    out = {
        "errors": errors,
        "own_files": full_params(model3),
        "trained": trained,
        "own_moments": moments(opt3),
        "trained_moments": trained_moments,
        "live_marked": any(hasattr(v, "_scopedlite_shard_of") for s in opt.state.values() for v in s.values()),
    }
    seen = from_every_rank(out)
    if run.is_global_zero:
        write(seen)
