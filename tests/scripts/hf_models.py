"""Hugging Face GPT-2 and Llama (tiny configs, no download), unchanged, under one strategy.

argv: strategy folder. One launch does every check (2 ranks; 1 under "single"): build inside
lite.sharded_init(), lite.setup with AdamW, two epochs each inside lite.join over uneven
shards, model.config, model.generate, model.save_pretrained, a fresh sharded_init(empty=True)
model given the weights by lite.load (a lite.save checkpoint) and by lite.load_pretrained
(the save_pretrained folder); a torch.compile'd model trained beside an uncompiled one; a
thread's collective. Rank 0 writes the JSON the test reads and the full state dicts (.pt).
Strategy "model_parallel": Llama only, with the tensor-parallel plan below, on a 2 x 2 mesh
(4 ranks), the same checks but torch.compile's.
"""

import concurrent.futures
import math
import sys
from pathlib import Path

import torch

import scopedlite as lite
from _common import write
from _hf_common import BATCH, EPOCHS, LR, SmallNet, build, compile_data, generate, quiet, tokens
from scopedlite._io.pretrained import PretrainedWeights

strategy, folder = sys.argv[1], Path(sys.argv[2])

# What lite.load_pretrained reads: the elements of every piece this rank took from the files
# (a whole tensor, or rows of one), seen where PretrainedWeights reads them.
read: list[int] = []
_full, _rows = PretrainedWeights.full, PretrainedWeights.rows


def _counted_full(self, name):
    tensor = _full(self, name)
    read.append(tensor.numel())
    return tensor


def _counted_rows(self, name, start, stop):
    if not self.shape(name):
        return _rows(self, name, start, stop)  # a scalar: read (and counted) by full
    tensor = _rows(self, name, start, stop)
    read.append(tensor.numel())
    return tensor


PretrainedWeights.full, PretrainedWeights.rows = _counted_full, _counted_rows
devices = 1 if strategy == "single" else 2
KINDS = ("gpt2", "llama")


def llama_plan(model, mesh):
    """The user's tensor-parallel plan for Llama (torchtitan's shape): attention and MLP
    projections split over the tensor-parallel ranks, then FSDP over the replicas."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"} | {"self_attn.o_proj": RowwiseParallel()}
    plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tensor_parallel"], plan)
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


if strategy == "model_parallel":  # 2 replicas of 2 ranks: the data of ddp on 2 ranks
    strategy, devices, KINDS = lite.ModelParallelStrategy(llama_plan, data_parallel=2, tensor_parallel=2), 4, ("llama",)


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full values under the plain module's names (every rank calls: gathers)."""
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def empty_model(kind: str):
    with lite.sharded_init(empty=True):
        model = build(kind)
    return lite.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))


calls = []


def counting_backend(graph, example_inputs):  # a torch.compile backend that runs the graph as is
    calls.append(len(graph.graph.nodes))
    return graph.forward


results = {}
with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=120) as run:
    quiet()
    rank = run.global_rank
    # a thread started in the block finds the run: its collective is the world's
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        results["thread_sum"] = pool.submit(
            lambda: lite.all_reduce(torch.tensor(run.data_parallel_rank + 1.0)).item()
        ).result()

    for kind in KINDS:
        out = results[kind] = {}
        torch.manual_seed(0)
        with lite.sharded_init():
            model = build(kind)
        model, opt = lite.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
        initial = plain_state(model)
        out["config"] = [type(model.config).__name__, model.config.num_hidden_layers, model.config.vocab_size]

        loader = lite.setup_dataloader(
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens()), batch_size=BATCH)
        )
        out["losses"] = []
        out["batches"] = []
        for _ in range(EPOCHS):
            with lite.join(model):
                count = 0
                for (x,) in loader:
                    loss = model(input_ids=x, labels=x).loss
                    lite.backward(loss)
                    opt.step()
                    opt.zero_grad()
                    out["losses"].append(lite.all_reduce(loss.detach(), op="mean").item())
                    count += 1
            out["batches"].append(lite.all_gather(torch.tensor(count)).tolist())
        final = plain_state(model)
        out["generated"] = generate(model)
        model.save_pretrained(folder / kind)  # every rank calls it; rank 0 writes
        lite.save(folder / f"{kind}-ckpt", {"model": model, "opt": opt})

        loaded, loaded_opt = empty_model(kind)  # lite.load of the lite.save checkpoint
        lite.load(folder / f"{kind}-ckpt", {"model": loaded, "opt": loaded_opt})
        out["load_equal"] = same(plain_state(loaded), final)
        pretrained, _ = empty_model(kind)  # the save_pretrained folder, each rank its part
        read.clear()
        lite.load_pretrained(pretrained, folder / kind)
        weights = PretrainedWeights(folder / kind)
        out["pretrained_read"] = [sum(read), sum(math.prod(weights.shape(n)) for n in weights.names())]
        out["pretrained_equal"] = same(plain_state(pretrained), final)
        out["pretrained_generated"] = generate(pretrained)
        if rank == 0:
            torch.save({"initial": initial, "final": final}, folder / f"{kind}.pt")
        del model, opt, loaded, loaded_opt, pretrained

    if KINDS != ("llama",):  # not under model_parallel: SmallNet has no plan
        # torch.compile(model) before setup: trains as the uncompiled model, plain state dict keys
        torch.manual_seed(0)
        compiled = torch.compile(SmallNet(), backend=counting_backend)
        model, opt = lite.setup(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
        x, y = compile_data()
        for _ in range(3):
            lite.backward(torch.nn.functional.mse_loss(model(x[rank::devices]), y[rank::devices]))
            opt.step()
            opt.zero_grad()
        results["compile"] = {
            "keys": list(model.state_dict()),
            "graphs": len(calls),
            "params": [v.flatten().tolist() for v in plain_state(model).values()],
        }
    if run.is_global_zero:
        write(results)
