"""torch's own ``Join([model])`` around a set-up DDP model, as a torchrun script keeps it, over
uneven batches (argv: none). Rank 0 has 3 batches, rank 1 one; rank 1 shadows rank 0's last
two backwards with zero buckets. Then an even step on both ranks, and a step whose backward rank
1 skips, still refused at the next backward (caught on both ranks).

The ranks' comparison of their training forwards (ddp/counted.py) pauses inside the block and
starts again after it: before, rank 1's shadow all-reduce was refused ("reached this backward
after different numbers of training forwards"), torch's documented API broken under ddp.
"""

import torch
from torch.distributed.algorithms.join import Join

import scopedlite as lite
from _common import from_every_rank, make_model, params, write
from _common import torch_join_batch as batch

BATCHES = [3, 1]  # per rank


with lite.launch(strategy="ddp", devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def step(x):
        lite.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()

    with Join([model]):
        for i in range(BATCHES[rank]):
            step(batch(rank, i))
    after_join = params(model)
    step(batch(rank, 5))  # an even step: compared, not refused
    after_even = params(model)
    error = ""
    try:
        for i in (6, 7):
            loss = model(batch(rank, i)).pow(2).mean()
            if rank == 1 and i == 6:
                continue  # rank 1 skips a step (a non-finite loss): refused at the next backward
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        error = str(e)
    seen = from_every_rank({"after_join": after_join, "after_even": after_even, "error": error})
    if rank == 0:
        write(seen)
