"""``model.load_state_dict`` and ``opt.load_state_dict`` on rank 0 alone after lite.setup
(argv: strategy): refused on rank 0 at once, naming rank 1's forward and the fix, before
anything is loaded. Before, under ddp rank 0's replica alone took the values and the replicas
parted for the rest of the run; under ZeRO-1/2 rank 0's partition of the master weights took
them and the model became a mix; under fsdp rank 0's shards alone changed.

The correct part: every rank loads the same model state (under ddp and fsdp also the
optimizer's: SGD with momentum), from a plain torch run, with the model's and the optimizer's
own load_state_dict (under DeepSpeed the plain optimizer's is refused on every rank, naming
lite.load: the engine holds the state in its flat partitions), then trains two steps: equal to
plain torch (under fsdp each rank takes its shard of each full tensor: fsdp/full_loads.py;
before, torch refused the model's load and took the optimizer's full momenta, on which the next
step failed). Then the loads on rank 0 alone (caught; under fsdp of the state dicts the model
and optimizer gave on every rank) and two more steps on every rank: still plain torch's, on
every rank.
"""

import copy
import sys

import torch

import scopedlite as lite
from _common import from_every_rank, full_params, make_model, params, write

LR, MOMENTUM = 0.05, 0.9


def batches(rank, n):
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 4, generator=g) for _ in range(n)]


def loss_of(model, x):
    return model(x).pow(2).mean()


def saved_state():
    """A plain run's model and optimizer state (momentum buffers filled): what is loaded."""
    model = make_model(3)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x in batches(7, 2):
        loss_of(model, x).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), opt.state_dict()


def reference(model_state, opt_state):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model.load_state_dict(model_state)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    data = [batches(r, 4) for r in (0, 1)]
    for i in range(4):
        (sum(loss_of(model, data[r][i]) for r in (0, 1)) / 2).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


strategy = sys.argv[1]
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    model_state, opt_state = saved_state()
    plain_opt_state = None
    if strategy.startswith("deepspeed"):  # its optimizer holds flat partitions: lite.load converts a plain one
        plain_opt_state, opt_state = opt_state, None
    expected = reference(model_state, copy.deepcopy(opt_state))  # torch loads share the tensors
    net = make_model()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM))
    model.load_state_dict(model_state)  # every rank: passes
    if opt_state is not None:
        opt.load_state_dict(copy.deepcopy(opt_state))
    data = batches(rank, 4)
    out = {"refused": {}, "plain_optimizer": None}
    if plain_opt_state is not None:  # every rank: refused, naming lite.load; nothing loaded
        try:
            opt.load_state_dict(plain_opt_state)
        except ValueError as e:
            out["plain_optimizer"] = str(e)

    def train(x):
        lite.backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()

    for x in data[:2]:
        train(x)
    other_model = make_model(5).state_dict() if strategy != "fsdp" else model.state_dict()
    other_opt = copy.deepcopy(opt.state_dict()) if not strategy.startswith("deepspeed") else None
    if rank == 0:
        loads = {"model": lambda: model.load_state_dict(other_model)}
        if other_opt is not None:
            loads["optimizer"] = lambda: opt.load_state_dict(other_opt)
        for what, load in loads.items():
            try:
                load()
                out["refused"][what] = None
            except lite.MethodCalledOnSomeRanksError as e:
                out["refused"][what] = str(e)
    for x in data[2:]:
        train(x)
    out["trained"] = full_params(model)
    out["reference"] = expected
    seen = from_every_rank(out)
    if rank == 0:
        write(seen)
