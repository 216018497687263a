"""ZeRO-3: sharded_init partitions parameters as they are built; save -> train on -> load
restores outputs exactly (model and optimizer state); the checkpoint consolidates to one fp32
state dict; join over a training and an evaluation engine at once and setup_optimizers are
refused with the reason (clip_gradients and no_backward_sync work: tests/test_one_script.py).

argv: checkpoint_dir
"""

import os
import sys

import torch

import scopedlite as lite
from _common import write


def make_wide(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 32, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def refused(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "not refused"


ckpt = sys.argv[1]
env_before = dict(os.environ)
probe = torch.randn(5, 32, generator=torch.Generator().manual_seed(7))
with lite.launch(strategy="deepspeed_stage_3", devices=2, accelerator="cpu", timeout=120) as run:
    import deepspeed

    with lite.sharded_init():
        model = make_wide()
    shards = [{"full": p.ds_numel, "local": p.ds_tensor.numel(), "materialised": p.numel()} for p in model.parameters()]
    # "32-true" builds float32 shards on every rank, whatever fp16 support DeepSpeed's CPU
    # accelerator reports on this machine (zero.Init ignores an explicit dtype where it
    # reports none, and built bfloat16 shards there).
    local_dtypes = sorted(
        {str(p.dtype) for p in model.parameters()} | {str(p.ds_tensor.dtype) for p in model.parameters()}
    )
    all_dtypes = lite.all_gather(torch.tensor([len(local_dtypes) == 1 and local_dtypes[0] == "torch.float32"]))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        built = [p.detach().flatten().tolist() for p in model.parameters()]

    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

    def train(step: int) -> None:
        x, y = batch(step, run.global_rank)
        lite.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    def outputs() -> list[float]:
        with torch.no_grad():
            return model(probe).flatten().tolist()

    for step in range(3):
        train(step)
    at_save = outputs()
    lite.save(ckpt, {"model": model, "opt": opt, "step": 3, "note": "hello"})
    train(3)
    after_one = outputs()
    for step in range(4, 7):
        train(step)
    moved = outputs()
    state = {"model": model, "opt": opt, "step": 0}
    rest = lite.load(ckpt, state)
    at_load = outputs()
    lite.save(ckpt, {"model": model, "opt": opt, "step": 3, "note": "again"})  # replaces the folder
    leftovers = sorted(os.listdir(os.path.dirname(os.path.abspath(ckpt))))
    train(3)
    after_one_again = outputs()

    # a second model set up without an optimizer: an engine for evaluation beside the trained one
    evaluator = lite.setup(make_wide())
    with torch.no_grad():
        evaluated = evaluator(probe).flatten().tolist()
    train(7)  # lite.backward still finds the one engine that trains

    refusals = {
        "join": refused(lambda: lite.join(model, evaluator).__enter__()),
        "setup_optimizers": refused(lambda: lite.setup_optimizers(torch.optim.SGD(make_wide().parameters(), lr=0.1))),
    }
    result = {
        "shards": shards,
        "built": built,
        "at_save": at_save,
        "after_one": after_one,
        "moved": moved,
        "at_load": at_load,
        "after_one_again": after_one_again,
        "step": state["step"],
        "leftovers": leftovers,
        "evaluator": type(evaluator).__name__,
        "evaluated": lite.all_gather(torch.tensor(evaluated)).tolist(),  # every rank's outputs
        "rest": rest,
        "refusals": refusals,
        "sum_local": lite.all_reduce(sum(s["local"] for s in shards)),
        "dtypes": local_dtypes,
        "float32_on_every_rank": all_dtypes.flatten().tolist(),
    }
    result = lite.broadcast(result, src=0)


# After the block, once, in the main process: the environment is as it was (DeepSpeed reads
# RANK, LOCAL_RANK, ... which the strategy set for the run), and one fp32 state dict.
def ours(env):  # torch writes TORCHINDUCTOR_* on first use of some modules; not ours (as in conftest)
    return {k: v for k, v in env.items() if not k.startswith("TORCHINDUCTOR_")}


result["env_restored"] = ours(os.environ) == ours(env_before)
consolidated = lite.consolidate_deepspeed_checkpoint(ckpt)
plain = make_wide(seed=1)
plain.load_state_dict(consolidated)
with torch.no_grad():
    result["consolidated"] = plain(probe).flatten().tolist()
result["consolidated_keys"] = sorted(consolidated)
write(result)
