"""Train under a DeepSpeed strategy; rank 0 writes the full parameters and our collectives.

argv: strategy n batch_size [precision] [accumulate]

With ``accumulate`` the engine accumulates 2 micro-batches of batch_size / 2 per step
(``gradient_accumulation_steps: 2``); the loop calls backward and step on every micro-batch.
"""

import sys

import torch
from _common import make_data, make_model, write

import scopedlite as lite

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
    if run.is_global_zero:
        write(result)
