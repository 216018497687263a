"""2D parallelism on 4 real gloo ranks (data_parallel=2 x tensor_parallel=2) - training,
evaluation, checkpoints, lite.join over uneven data-parallel shards - then the checkpoints
loaded under fsdp (a second launch block, which saves its own folder) and on another mesh
shape (a third: 1 x 2 on 2 ranks, which loads FSDP's folder too).

The plan is the one written out in docs/strategies.md (executed from there). argv: a folder
for the checkpoints. Rank 0 writes what the test compares with its one-process reference.
"""

import re
import sys
from pathlib import Path

import torch

import scopedlite as lite
from _common import reductions_during, write
from _model_parallel_common import (
    BATCH,
    JOIN_CLIP,
    JOIN_EMPTY_SHARES,
    JOIN_SEED,
    JOIN_SHARES,
    N_TRAIN,
    data,
    eval_data,
    join_eval_data,
    make_net,
    probe,
    train,
)

folder = Path(sys.argv[1])
docs = (Path(__file__).resolve().parents[2] / "docs" / "strategies.md").read_text()
plan = next(b for b in re.findall(r"```python\n(.*?)```", docs, re.S) if "def parallelize(" in b)
namespace: dict = {}
exec(plan, namespace)  # the docs' plan and strategy, as written there
parallelize, strategy = namespace["parallelize"], namespace["strategy"]


def full(model: torch.nn.Module) -> list[list[float]]:
    """Every parameter whole (a collective). After a forward without backward FSDP keeps the
    root's parameters gathered over the data-parallel dimension: some are plain tensors then."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).flatten().tolist() for p in model.parameters()]


def outputs(model: torch.nn.Module) -> list[float]:
    with torch.no_grad():
        return model(probe()).flatten().tolist()


def one_more_step(model, opt, share: int, shares: int) -> list[list[float]]:
    """One step on the last global batch, this replica's rows of it."""
    _, x, y = (t[N_TRAIN - 2 * BATCH :] for t in data())
    lite.backward(torch.nn.functional.mse_loss(model(x[share::shares]), y[share::shares]))
    opt.step()
    opt.zero_grad()
    return full(model)


def loader_over(dataset) -> "torch.utils.data.DataLoader":
    return lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=BATCH))


out: dict = {}
with lite.launch(strategy=strategy, devices=4, accelerator="cpu", timeout=90) as run:
    mine: dict = {}
    strategy_here = run.strategy
    mine["mesh"] = [list(strategy_here.mesh.mesh_dim_names), list(strategy_here.mesh.shape)]
    mine["data_parallel"] = [run.data_parallel_rank, run.data_parallel_size]
    mine["replica_ranks"] = list(strategy_here.replica_ranks)
    # rank 0's seed is the one sharded_init replays; the others draw differently on purpose
    lite.seed_everything(0 if run.global_rank == 0 else 7)
    with lite.sharded_init():
        model = make_net()
        model.note = "mine"  # the user's own attribute and method, answered by the set-up model
        model.width = lambda: model[0].out_features
    mine["meta"] = all(p.is_meta for p in model.parameters())
    model, opt = lite.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    mine["answers"] = [model.note, model.width(), len(model), type(model[3]).__name__]
    mine["state_keys"] = list(model.state_dict())
    mine["rng_after_setup"] = torch.rand(1).item()
    out["initial"] = full(model)
    mine["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    mine["placements"] = {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()}
    mine["opt_on_model"] = all(any(q is p for q in model.parameters()) for g in opt.param_groups for p in g["params"])

    loader = loader_over(torch.utils.data.TensorDataset(*data()))
    mine["scatters"] = []  # FSDP's gradient reductions per backward: none inside no_backward_sync

    def counted_backward(loss):
        mine["scatters"].append(reductions_during(lambda: lite.backward(loss), kind="reduce_scatter"))

    mine["train_rows"], norms = train(
        model,
        opt,
        loader,
        counted_backward,
        lambda enabled: lite.no_backward_sync(model, enabled=enabled),
        lambda **kw: lite.clip_gradients(model, opt, **kw),
    )
    mine["norms"] = {k: float(v) for k, v in norms.items()}
    out["trained"] = full(model)

    # no_grad evaluation: every sample once, over the replicas; collectives span the world
    evaluation = loader_over(torch.utils.data.TensorDataset(*eval_data()))
    mine["eval_rows"], total, count = [], torch.zeros(()), torch.zeros(())
    with torch.no_grad():
        for index, x, y in evaluation:
            mine["eval_rows"] += index.tolist()
            total += torch.nn.functional.mse_loss(model(x), y, reduction="sum")
            count += len(index)
    out["eval_mean"] = float(lite.all_reduce(total) / lite.all_reduce(count))
    # each replica counted once, as ddp counts each rank: the ranks of a replica agree
    mine["eval_count"] = float(lite.all_reduce(count))
    mine["eval_gathered"] = lite.gather_for_metrics(torch.tensor(mine["eval_rows"])).tolist()
    mine["replica_mean"] = lite.all_reduce(run.data_parallel_rank, op="mean")
    mine["replica_gather"] = lite.all_gather(run.data_parallel_rank).tolist()
    try:  # the ranks of a replica disagree: refused on every rank
        lite.all_reduce({"loss": torch.tensor([1.0, float(run.global_rank)])})
        mine["replica_error"] = "not refused"
    except lite.ReplicaValuesDifferError as e:
        mine["replica_error"] = str(e)

    # checkpoints in the middle of a pass: the loader read one batch of its second pass
    passing = iter(loader)
    mine["taken_rows"] = next(passing)[0].tolist()
    state = {"model": model, "opt": opt, "step": 4, "loader": loader}
    out["at_save"], out["outputs_at_save"] = full(model), outputs(model)
    lite.save(folder / "sharded", state)
    strategy_here.state_dict_type = "full"  # the same state as one file, for the same checks
    lite.save(folder / "full.pt", state)
    strategy_here.state_dict_type = "sharded"
    lite.save(folder / "background", state, blocking=False)  # the step below runs while it is written
    out["after_step"] = one_more_step(model, opt, run.data_parallel_rank, run.data_parallel_size)
    for kind in ("sharded", "full.pt", "background"):
        state = {"model": model, "opt": opt, "step": 0}
        lite.load(folder / kind, state)
        mine[f"{kind}_exact"] = full(model) == out["at_save"] and outputs(model) == out["outputs_at_save"]
        mine[f"{kind}_step"] = state["step"]
        mine[f"{kind}_next_step_exact"] = (
            one_more_step(model, opt, run.data_parallel_rank, run.data_parallel_size) == out["after_step"]
        )

    # a checkpoint lite.save wrote in one process (the test, strategy single) resumes here
    torch.manual_seed(99)  # other values: what the checkpoint holds must replace them
    moved = make_net()
    moved, mopt = lite.setup(moved, torch.optim.AdamW(moved.parameters(), lr=1e-2))
    state = {"model": moved, "opt": mopt, "step": 0}
    lite.load(folder / "single.ckpt", state)
    mine["from_single"] = {"params": full(moved), "step": state["step"]}
    mine["from_single"]["after_step"] = one_more_step(moved, mopt, run.data_parallel_rank, run.data_parallel_size)
    # the same file read with torch.load and loaded with torch's own load_state_dict on every
    # rank, as a DDP script resumes: each rank takes its slice of each full tensor
    torch.manual_seed(98)
    again = make_net()
    again, aopt = lite.setup(again, torch.optim.AdamW(again.parameters(), lr=1e-2))
    saved = torch.load(folder / "single.ckpt", weights_only=True)
    again.load_state_dict(saved["model"])
    aopt.load_state_dict(saved["opt"])
    mine["plain_loads"] = {"params": full(again)}
    mine["plain_loads"]["after_step"] = one_more_step(again, aopt, run.data_parallel_rank, run.data_parallel_size)

    # lite.join over uneven data-parallel shards (replica 0: 5 batches, replica 1: 3), twice:
    # dividing by the initial number of replicas (clipped by norm), then by the running ones
    lite.seed_everything(JOIN_SEED)
    net = make_net()
    joined, jopt = lite.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    share = torch.utils.data.Subset(torch.utils.data.TensorDataset(*data()), JOIN_SHARES[run.data_parallel_rank])
    shard = lite.setup_dataloader(torch.utils.data.DataLoader(share, batch_size=BATCH), use_distributed_sampler=False)
    mine["join"] = []
    for divide in (True, False):
        rows, losses, norms = [], [], []
        with lite.join(joined, divide_by_initial_world_size=divide):
            for index, x, y in shard:
                rows += index.tolist()
                loss = torch.nn.functional.mse_loss(joined(x), y)
                losses.append(float(lite.all_reduce(loss.detach(), op="mean")))  # over the running ranks
                lite.backward(loss)
                if divide:
                    norms.append(float(lite.clip_gradients(joined, jopt, max_norm=JOIN_CLIP)))
                jopt.step()
                jopt.zero_grad()
            seen = int(lite.all_reduce(len(rows)))  # after the loop, inside the block: waits for the others
        mine["join"].append({"rows": rows, "losses": losses, "norms": norms, "seen": seen, "params": full(joined)})

    # a replica with no data (it replays from an example the others send), in an accumulation
    # window: replica 0 accumulates 2 batches (lite.no_backward_sync) into one step
    empty = torch.utils.data.Subset(torch.utils.data.TensorDataset(*data()), JOIN_EMPTY_SHARES[run.data_parallel_rank])
    shard = lite.setup_dataloader(torch.utils.data.DataLoader(empty, batch_size=BATCH), use_distributed_sampler=False)
    rows = []
    with lite.join(joined):
        for i, (index, x, y) in enumerate(shard):
            rows += index.tolist()
            with lite.no_backward_sync(joined, enabled=i == 0):
                lite.backward(torch.nn.functional.mse_loss(joined(x), y))
            if i == 1:
                jopt.step()
                jopt.zero_grad()
        seen = int(lite.all_reduce(len(rows)))
    mine["join"].append({"rows": rows, "seen": seen, "params": full(joined)})

    # no_grad evaluation inside join, sharded by the sampler: 5 rows (2 batches) and 4 (1 batch)
    evaluation = loader_over(torch.utils.data.TensorDataset(*join_eval_data()))
    rows, sse, gathered = [], torch.zeros(()), []
    with torch.no_grad(), lite.join(joined):
        for index, x, y in evaluation:
            rows += index.tolist()
            sse += ((joined(x) - y) ** 2).sum()
            gathered += lite.gather_for_metrics(index).tolist()  # the second: replica 0 alone
        totals = lite.all_reduce(torch.stack([sse, torch.tensor(float(len(rows)))]))
    mine["join_eval"] = {"rows": rows, "totals": totals.tolist(), "gathered": gathered}

    # refusals: a replica whose ranks do not run out together, a plan that leaves the replicas apart
    try:
        with torch.no_grad(), lite.join(joined):
            for _ in range(2 if run.global_rank == 3 else 1):  # rank 3 runs on, rank 2 (its replica) leaves
                joined(probe())
        mine["split_error"] = "not refused"
    except RuntimeError as e:
        mine["split_error"] = str(e)
    strategy_here.parallelize = lambda m, mesh: m  # a plan that forgets fully_shard
    try:
        lite.setup(make_net())
    except ValueError as e:
        mine["unsynced_error"] = str(e)
    strategy_here.parallelize = parallelize
    # torch.compile(model) before setup: compiled (the backend saw graphs), trains as one process
    graphs = []

    def counting_backend(graph, example_inputs):  # runs the graph as it is
        graphs.append(len(graph.graph.nodes))
        return graph.forward

    torch.manual_seed(0)
    net = torch.compile(make_net(), backend=counting_backend)
    compiled, copt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    _, x, y = data()
    for step in range(2):
        rows = slice(step * 2 * BATCH + run.data_parallel_rank, (step + 1) * 2 * BATCH, run.data_parallel_size)
        lite.backward(torch.nn.functional.mse_loss(compiled(x[rows]), y[rows]))
        copt.step()
        copt.zero_grad()
    mine["compiled"] = {"graphs": len(graphs), "keys": list(compiled.state_dict()), "params": full(compiled)}

    out["ranks"] = lite.all_gather(torch.zeros(1)).shape[0]
    out["per_rank"] = [lite.broadcast(mine, src=r) for r in range(run.world_size)]

# fsdp on 2 ranks: the model_parallel folder loads into FSDP's shards (values, step, AdamW's
# next step); FSDP's own folder, saved after that step, loads on the 1 x 2 mesh below
with lite.launch(strategy="fsdp", devices=2, accelerator="cpu", timeout=90) as run:
    torch.manual_seed(321)  # other values: what the checkpoint holds must replace them
    model = make_net()
    model, opt = lite.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "opt": opt, "step": 0}
    lite.load(folder / "sharded", state)
    moved = {"params": full(model), "step": state["step"]}
    moved["after_step"] = one_more_step(model, opt, run.global_rank, run.world_size)
    lite.save(folder / "fsdp", {"model": model, "opt": opt, "step": 5})
    out["fsdp"] = [lite.broadcast(moved, src=r) for r in range(run.world_size)]

# another mesh shape: 1 x 2 on 2 ranks (a later block forks), one full file per save
other = lite.ModelParallelStrategy(parallelize, data_parallel=1, state_dict_type="full")
with lite.launch(strategy=other, devices=2, accelerator="cpu", timeout=90) as run:
    mine = {"mesh": list(run.strategy.mesh.shape), "data_parallel": [run.data_parallel_rank, run.data_parallel_size]}
    torch.manual_seed(123)  # other values: what the checkpoint holds must replace them
    model = make_net()
    model, opt = lite.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = loader_over(torch.utils.data.TensorDataset(*data()))
    for kind in ("sharded", "full.pt"):
        state = {"model": model, "opt": opt, "step": 0, "loader": loader}
        lite.load(folder / kind, state)
        mine[f"{kind}_params"] = full(model)
        mine[f"{kind}_outputs"] = outputs(model)
        mine[f"{kind}_step"] = state["step"]
        mine[f"{kind}_rest_of_pass"] = [row for batch in loader for row in batch[0].tolist()]
        # the optimizer state came too: one more step on both replicas' rows at once
        mine[f"{kind}_after_step"] = one_more_step(model, opt, 0, 1)
    state = {"model": model, "opt": opt, "step": 0}
    lite.load(folder / "fsdp", state)  # FSDP's folder, on this mesh
    mine["from_fsdp"] = {"params": full(model), "step": state["step"]}
    out["other_mesh"] = [lite.broadcast(mine, src=r) for r in range(run.world_size)]

write(out)
