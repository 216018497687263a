"""Under fsdp, a state dict torch.save'd by rank 0 alone and loaded on every rank (the DDP way
to resume) is refused on the rank it would mislead; one file per rank loads back exactly.

Before, every rank loaded rank 0's shard into its own place, silently: the parameters came
out wrong on every rank.
"""

import io

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, write


def whole(model):
    return [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]  # every rank calls it


with lite.launch(strategy="fsdp", devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    lite.backward(model(x).pow(2).mean())
    opt.step()
    trained = whole(model)

    # rank 0 alone writes the file; every rank reads it into a fresh set-up model
    blob = [None]
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        blob = [buffer.getvalue()]
    blob = lite.broadcast(blob, src=0)  # as a shared file system would
    fresh = make_model(seed=5)
    model2, _ = lite.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    error = None
    try:
        model2.load_state_dict(torch.load(io.BytesIO(blob[0])))
    except ValueError as e:
        error = str(e)

    # one file per rank, each loading its own: exact
    own = io.BytesIO()
    torch.save(model.state_dict(), own)
    net3 = make_model(seed=6)
    model3, _ = lite.setup(net3, torch.optim.SGD(net3.parameters(), lr=0.1))
    model3.load_state_dict(torch.load(io.BytesIO(own.getvalue())))
    out = {"error": error, "own_files": whole(model3), "trained": trained}
    seen = from_every_rank(out)
    if run.is_global_zero:
        write(seen)
