"""The join protocol's rounds on even data, counted where they are opened (every round is one
all-gather of the ranks' step messages started by ``gather_into_later`` in join/session.py;
the strategy's own collectives - FSDP's all-gathers, DeepSpeed's - are not counted).

argv: strategy. Writes, per rank, the rounds of a 2-step and a 5-step block over a set-up
loader ("2", "5") and over a plain list of the same batches ("list2", "list5"), and of those
the rounds waited for where they were opened ("awaited": the others were posted, read at a
later round).
"""

import sys
from functools import partial

import torch

import scopedlite as lite
from _common import from_every_rank, make_data, make_model, write
from scopedlite._strategies.join import session

strategy = sys.argv[1]
opened = []
original = session.gather_into_later


def counted(*args, **kwargs):
    opened.append(1)
    return original(*args, **kwargs)


session.gather_into_later = counted
awaited = []
exchange = session.JoinSession._exchange


def counted_exchange(self, said):
    awaited.append(1)
    return exchange(self, said)


session.JoinSession._exchange = counted_exchange


def rounds_during(fn) -> tuple[int, int]:
    before, waited = len(opened), len(awaited)
    fn()
    return len(opened) - before, len(awaited) - waited


def block(model, opt, batches):
    with lite.join(model):
        for x, y in batches:
            lite.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()


with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=120) as run:
    counts = {}
    for steps in (2, 5):
        model = make_model()
        model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(2 * steps * 2), batch_size=2))
        listed = list(loader)
        counts[str(steps)], counts[f"awaited{steps}"] = rounds_during(partial(block, model, opt, loader))
        counts[f"list{steps}"], counts[f"awaited_list{steps}"] = rounds_during(partial(block, model, opt, listed))
    everyone = from_every_rank(counts)
    if run.global_rank == 0:
        write(everyone)
