"""HSDP on 4 real gloo ranks: ``FSDPStrategy(replicate_degree=2)``, 2 replicas of 2 shards.

One launch: ``sharded_init`` and the DDP user's set-up line, training with accumulation under
``lite.no_backward_sync`` and clipping (each backward's reducing collectives counted), a
forward on rank 0 alone (refused), a plain torch run's state dicts loaded with torch's own
``load_state_dict`` and one more step, then ``lite.join`` over uneven data (ranks with 3, 1, 0 and 2
batches) dividing by the initial and by the running world size. Rank 0 writes every rank's
record; tests/test_fsdp.py replays the recipe with plain torch in one process.
"""

import torch

import scopedlite as lite
from _common import from_every_rank, write
from _fsdp_common import (
    JOIN_BATCH,
    JOIN_CLIP,
    JOIN_SEED,
    join_rows,
    make_data,
    make_net,
    make_optimizer,
    plain_run_state,
    step_after_plain_load,
    train,
)


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def params(model: torch.nn.Module) -> list[list[float]]:
    return [full(p).detach().flatten().tolist() for p in model.parameters()]


def collectives_during(fn) -> dict[str, int]:
    """The c10d collectives this rank ran during ``fn()``, by name (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("c10d::") and "reduce" in event.name:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


strategy = lite.FSDPStrategy(replicate_degree=2)
with lite.launch(strategy=strategy, devices=4, accelerator="cpu", timeout=90) as run:
    rank, out, mine = run.global_rank, {}, {}
    # rank 0's seed is the one sharded_init replays; the others draw differently on purpose
    lite.seed_everything(0 if rank == 0 else 7)
    with lite.sharded_init():
        model = make_net()
    mine["meta"] = all(p.is_meta for p in model.parameters())
    model, opt = lite.setup(model, make_optimizer("adamw", model.parameters()))  # the DDP user's line
    mine["rng_after_setup"] = torch.rand(1).item()
    out["initial"] = params(model)
    mine["mesh"] = [list(model[0].weight.device_mesh.mesh_dim_names), model[0].weight.device_mesh.mesh.tolist()]
    mine["placements"] = [str(pl) for pl in model[0].weight.placements]
    mine["initial_local"] = [p.to_local().detach().flatten().tolist() for p in model.parameters()]
    mine["data_parallel"] = [run.data_parallel_rank, run.data_parallel_size]

    # rank r reads rows r::4 of each global batch of 8; the step after 3 plain ones accumulates
    # 2 micro-batches (the first inside no_backward_sync) and clips by norm
    x, y = make_data()
    counts: list[dict[str, int] | None] = []

    def backward(loss: torch.Tensor) -> None:
        if len(counts) in (0, 3, 4):  # counted (profiling costs): the first and the window's two
            counts.append(collectives_during(lambda: lite.backward(loss)))
        else:
            lite.backward(loss)
            counts.append(None)

    def clip() -> torch.Tensor:
        mine["norm_inf"] = float(lite.clip_gradients(model, opt, max_norm=1e9, norm_type=float("inf")))
        mine["norm_1"] = float(lite.clip_gradients(model, opt, max_norm=1e9, norm_type=1))
        return lite.clip_gradients(model, opt, max_norm=0.05)

    mine["norm"] = train(
        model,
        opt,
        lambda s: (x[s][rank::4], y[s][rank::4]),
        backward,
        lambda enabled: lite.no_backward_sync(model, enabled=enabled),
        clip,
    )
    mine["backward_collectives"] = counts
    out["trained"] = params(model)
    mine["trained_local"] = [p.to_local().detach().flatten().tolist() for p in model.parameters()]

    # rank 0 evaluates alone while the others wait in a collective: refused at once (SPEC 9)
    if rank == 0:
        try:
            with torch.no_grad():
                model(x[:2])
            mine["alone"] = "no error"
        except lite.ForwardOnSomeRanksError as e:
            mine["alone"] = str(e)
    lite.barrier()

    # a plain torch run's state dicts, loaded on every rank with torch's own load_state_dict as
    # a DDP script resumes: each rank takes its shard of each full tensor (fsdp/full_loads.py)
    model_state, opt_state = plain_run_state()
    torch.manual_seed(11)  # other values: the loads must replace them
    net = make_net()
    resumed, ropt = lite.setup(net, make_optimizer("adamw", net.parameters()))
    resumed.load_state_dict(model_state)
    ropt.load_state_dict(opt_state)
    out["plain_loaded"] = params(resumed)
    step_after_plain_load(resumed, ropt, lambda s: (x[s][rank::4], y[s][rank::4]), lite.backward)
    out["plain_loaded_step"] = params(resumed)

    # lite.join over uneven data, each rank its own rows: dividing by the initial world size
    # (clipped by norm, the mean loss over the running ranks each step), then by the running one
    lite.seed_everything(JOIN_SEED)
    net = make_net()
    joined, jopt = lite.setup(net, make_optimizer("adamw", net.parameters()))
    share = torch.utils.data.Subset(torch.utils.data.TensorDataset(*make_data()), join_rows(rank))
    loader = lite.setup_dataloader(
        torch.utils.data.DataLoader(share, batch_size=JOIN_BATCH), use_distributed_sampler=False
    )
    mine["join"] = []
    for divide in (True, False):
        losses, norms, steps = [], [], 0
        with lite.join(joined, divide_by_initial_world_size=divide):
            for bx, by in loader:
                steps += 1
                loss = torch.nn.functional.mse_loss(joined(bx), by)
                losses.append(float(lite.all_reduce(loss.detach(), op="mean")))  # over the running ranks
                lite.backward(loss)
                if divide:
                    norms.append(float(lite.clip_gradients(joined, jopt, max_norm=JOIN_CLIP)))
                jopt.step()
                jopt.zero_grad()
            total = int(lite.all_reduce(steps))  # after the loop, inside the block: waits for the others
        mine["join"].append({"losses": losses, "norms": norms, "steps": total, "params": params(joined)})
    out["per_rank"] = from_every_rank(mine)

write(out)
