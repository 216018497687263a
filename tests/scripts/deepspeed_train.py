"""Train under a DeepSpeed strategy; rank 0 writes the full parameters and our collectives.

argv: strategy n batch_size [precision] [accumulate]

With ``accumulate`` the engine accumulates 2 micro-batches of batch_size / 2 per step
(``gradient_accumulation_steps: 2``); the loop calls backward and step on every micro-batch.
"""

import os
import sys

import torch

import scopedlite as lite
from _common import make_data, make_model, write

strategy, n, batch_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
precision = sys.argv[4] if len(sys.argv) > 4 else "32-true"
accumulate = len(sys.argv) > 5 and sys.argv[5] == "accumulate"
if accumulate:
    from scopedlite._strategies.registry import STRATEGIES

    named = STRATEGIES[strategy]()
    strategy = lite.DeepSpeedStrategy(
        stage=named.stage,
        offload_optimizer=named.offload_optimizer,
        offload_parameters=named.offload_parameters,
        config={"gradient_accumulation_steps": 2},
    )
    batch_size //= 2


def resume_mid_epoch(path):
    """Exact mid-epoch resume under the engine: a model with dropout, SGD with momentum and a
    shuffled loader is saved after 3 of its 8 steps; the pass goes on (the reference), then
    ``lite.load`` puts model, optimizer, loader position and random states back and the next
    pass continues the saved epoch. Each rank's losses and outputs, both ways."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(32), batch_size=2, shuffle=True))
    state = {"model": model, "opt": opt, "loader": loader}
    probe = make_data(4, seed=9).tensors[0]

    def rest_of_pass(save_after=None):
        losses = []
        for step, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step + 1 == save_after:
                lite.save(path, state)
        model.eval()
        with torch.no_grad():
            outputs = model(probe).flatten().tolist()
        model.train()
        return losses, outputs

    losses, outputs = rest_of_pass(save_after=3)
    lite.load(path, state)
    resumed, resumed_outputs = rest_of_pass()
    return {"reference": [losses[3:], outputs], "resumed": [resumed, resumed_outputs], "steps": len(losses)}


def join_refusals(rank):
    """What a joined rank cannot mirror is refused on every rank together under this stage too
    (tests/scripts/join_replay_refusals.py runs them under fsdp and ZeRO-3); the session still
    works after them. Every rank's messages."""
    model = make_model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(2, 4), torch.randn(2, 1)

    def step():
        lite.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    def lr_by_hand():
        with lite.join(model):
            step()
            opt.param_groups[0]["lr"] = 0.5
            step()

    def disagree():  # data-dependent control flow: the ranks announce different things
        with lite.join(model):
            lite.all_reduce(1) if rank == 0 else model(x)

    def plateau():
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        with lite.join(model):
            step()
            sched.step(1.0)

    def two_forwards():  # one loss from two forwards: a joined rank cannot replay it
        with lite.join(model):
            lite.backward(
                torch.nn.functional.mse_loss(model(x[:1]), y[:1]) + torch.nn.functional.mse_loss(model(x[1:]), y[1:])
            )

    def refused(fn):
        try:
            fn()
        except (RuntimeError, ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return "not refused"

    # lr_by_hand last: its second step is refused after its backward, which ZeRO 1/2 want
    # stepped before another backward (lite.backward refuses a second one)
    errors = {fn.__name__: refused(fn) for fn in (disagree, plateau, two_forwards, lr_by_hand)}
    model = make_model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with lite.join(model):
        for _ in range(2 if rank == 0 else 1):  # uneven: rank 1 replays rank 0's second step
            step()
    errors["after"] = lite.all_reduce(1)
    return [lite.broadcast(errors, src=r) for r in range(lite.current().world_size)]


with lite.launch(strategy=strategy, devices=2, accelerator="cpu", precision=precision, timeout=120) as run:
    import deepspeed

    model = make_model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(n), batch_size=batch_size))
    means = []
    for x, y in loader:
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y.to(out.dtype))  # one dtype: torch < 2.12
        lite.backward(loss)
        opt.step()
        opt.zero_grad()
        means.append(lite.all_reduce(loss.detach(), op="mean").item())
    inner = lite.current().strategy.unwrap(model)
    # Under ZeRO-3 a rank holds a shard of each parameter: gather them to read the whole.
    with deepspeed.zero.GatheredParameters(list(inner.parameters())):
        full = [p.detach().float().flatten().tolist() for p in inner.parameters()]
    gathered = lite.all_gather(torch.tensor(full[0]))
    with torch.no_grad():
        outputs = model(make_data(6, seed=5).tensors[0]).float().flatten().tolist()
    result = {
        "params": full,
        "first_param_on_each_rank": gathered.tolist(),
        "means": means,
        "outputs": outputs,
        "engine": type(model).__name__,
        "optimizer": type(opt).__name__,
        "stage": model.zero_optimization_stage(),
        "broadcast": lite.broadcast({"rank": run.global_rank}, src=1),
        "param_dtype": str(next(inner.parameters()).dtype),
    }
    if (
        precision == "32-true" and not accumulate
    ):  # one more check per stage (ZeRO-3's refusals: join_replay_refusals.py)
        if result["stage"] >= 2:
            result["resume"] = resume_mid_epoch(os.environ["OUT"] + ".ckpt")
        if result["stage"] <= 2:
            result["join_refusals"] = join_refusals(run.global_rank)
    if run.is_global_zero:
        write(result)
