"""A forward on some ranks only, as real scripts run one: rank 0 evaluates after training.

    python one_rank_forward.py STRATEGY

ddp: a BatchNorm model trains 3 steps, every rank evaluates (each must see rank 0's buffers,
as torch's DDP gives them), it trains a 4th step, then rank 0 alone evaluates while rank 1
goes to the end of the block: that evaluation must return (torch's DDP would broadcast
buffers there and hang).

Sharded strategies (fsdp, deepspeed_stage_3, model_parallel): every rank evaluates (exact);
rank 0 alone evaluates while rank 1 goes on to a training forward, then while rank 1 waits in
lite.barrier(), then after rank 1 reached the end of the block: each refused at once on rank
0, which then follows rank 1 and the run goes on. Under ZeRO-3 ``model.state_dict()`` (which
gathers) on rank 0 alone while rank 1 waits in ``lite.barrier()`` is refused at once too.
Then the fix the refusal names (a plain copy from ``model.state_dict()``) evaluates on rank 0
alone. Rank 0 saves ``torch.save(model.state_dict())`` as a DDP script does: under ZeRO-3 (full
tensors) ``lite.load`` reads it back; under FSDP2 (rank 0's DTensor shards only) it is refused on
every rank, naming how to save the whole model.
Writes what rank 0 saw to $OUT.
"""

from __future__ import annotations

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, fsdp_over_data_parallel, make_data, make_model, write

STEPS, BATCH = 3, 8  # a global batch of 8 rows a step, 4 per rank


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def eval_rows() -> torch.Tensor:
    return torch.linspace(-2, 2, 12).reshape(3, 4)


def tensor_parallel(model: torch.nn.Module, mesh: object) -> torch.nn.Module:
    """A tensor-parallel plan: the root stays a plain module, its forward runs collectives."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})  # type: ignore[index]


def strategy_of(name: str) -> object:
    if name == "model_parallel":
        return lite.ModelParallelStrategy(fsdp_over_data_parallel, data_parallel=2, tensor_parallel=1)
    if name == "model_parallel_tp":
        return lite.ModelParallelStrategy(tensor_parallel, data_parallel=1, tensor_parallel=2)
    return name


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One step on this replica's rows of the step's global batch."""
    x, y = make_data(BATCH * (STEPS + 1)).tensors
    strategy = lite.current().strategy
    replica, replicas = strategy.data_parallel_rank, strategy.data_parallel_size
    rows = slice(step * BATCH + replica, (step + 1) * BATCH, replicas)
    opt.zero_grad()
    lite.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
    opt.step()


def evaluate(model: torch.nn.Module) -> list[float]:
    model.eval()
    try:
        with torch.no_grad():
            return model(eval_rows()).flatten().tolist()
    finally:
        model.train()


def refused(model: torch.nn.Module) -> str:
    try:
        evaluate(model)
    except lite.ForwardOnSomeRanksError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def refused_call(call) -> str:
    try:
        call()
    except lite.MethodCalledOnSomeRanksError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def main(name: str) -> None:
    out: dict = {}
    with lite.launch(strategy=strategy_of(name), devices=2, accelerator="cpu", timeout=30) as run:
        rank = run.global_rank
        model = bn_model() if name == "ddp" else make_model()
        model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for step in range(STEPS):
            train_step(model, opt, step, rank)
        every = from_every_rank(evaluate(model))  # every rank evaluates
        out["every_rank"] = every
        if name == "ddp":
            train_step(model, opt, STEPS, rank)
            out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
            if rank == 0:  # rank 1 goes to the end of the block
                out["rank0_alone"] = evaluate(model)
                model.eval()  # and without torch.no_grad(), as scripts forget it
                out["rank0_alone_with_grad"] = model(eval_rows()).detach().flatten().tolist()
                model.train()
        else:
            if rank == 0:
                out["while_training"] = refused(model)
            train_step(model, opt, STEPS, rank)  # rank 1 went on to this; rank 0 follows it
            if rank == 0:
                out["while_in_barrier"] = refused(model)
                if name == "deepspeed_stage_3":  # gathers: rank 0 alone saving, as scripts do
                    out["state_dict_alone"] = refused_call(model.state_dict)
            lite.barrier()
            raw = model.state_dict()  # the fix the refusal names: every rank gathers
            if name != "deepspeed_stage_3":  # DTensor shards under FSDP2
                weights = {k: v.full_tensor() for k, v in raw.items()}
            else:
                weights = raw
            if rank == 0:  # as a DDP script saves: rank 0's state dict, whatever it holds
                torch.save(raw, "plain_state.pt")
            lite.barrier()
            try:
                lite.load("plain_state.pt", {"model": model})
                loaded = "loaded"
            except lite.CheckpointError as e:
                loaded = f"CheckpointError: {e}"
            out["plain_file"] = from_every_rank(loaded)
            if rank == 0:
                copy = make_model()
                copy.load_state_dict(weights)
                out["plain_copy"] = evaluate(copy)
                out["after_the_others_left"] = refused(model)
        if rank == 0:
            write(out)


if __name__ == "__main__":
    main(sys.argv[1])
