"""Three forked launch blocks in one process, as a notebook's cells run them: what each run
knows about the objects it set up lives in its own registry, which starts empty and is empty
again when the block ends, and nothing of ours is left on the user's module, on what setup
returned (torch's DDP module, a DeepSpeed engine) or on the user's optimizer. The models and
optimizers are kept past their block, as a notebook's namespace keeps them. Each block starts
as cleanly as the first: of the process-wide state (_core/process.py) it sees only its own
open block and no stop request; it holds its own store (strategy.connection), and none is
left after it. An LR scheduler built in the block is known to its run only, and torch's
scheduler classes are torch's own again after it.

argv: strategy
"""

import sys

import torch
import torch.distributed as dist

import scopedlite as lite
from _common import from_every_rank, write
from scopedlite._core.process import this_process

SCHEDULER_CLASSES = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.SequentialLR,
    torch.optim.lr_scheduler.ChainedScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)
TORCH_INITS = [vars(cls)["__init__"] for cls in SCHEDULER_CLASSES]


def torch_inits_untouched() -> bool:
    return [vars(cls)["__init__"] for cls in SCHEDULER_CLASSES] == TORCH_INITS


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).sum()


def ours(obj: object, built_by_setup: bool = False) -> list[str]:
    """The names in ``obj``'s instance ``__dict__`` that are ours, and an instance ``forward``
    or ``step`` / ``zero_grad`` that the class's own would hide; for a module, also a class of
    ours (FSDP's module is the user's: its class is ours during the run only), forward
    hooks of ours and parameters of a class of ours (ZeRO-3's, during the run only);
    ``built_by_setup``: a module lite.setup built (DDP's), whose class may
    stay ours. A DeepSpeed face (ours) is looked through to the engine behind it."""
    if "_lite_engine" in dir(type(obj)):
        obj = object.__getattribute__(obj, "_lite_engine")
    found = sorted(k for k in vars(obj) if "lite" in k.lower() or k in ("forward", "step", "zero_grad"))
    if isinstance(obj, torch.nn.Module):
        if type(obj).__module__.startswith("scopedlite") and not built_by_setup:
            found.append(f"class {type(obj).__name__}")
        hooks = [*obj._forward_pre_hooks.values(), *obj._forward_hooks.values()]
        found += [f"hook {h.__qualname__}" for h in hooks if getattr(h, "__module__", "").startswith("scopedlite")]
        found += [f"parameter class {type(p).__name__}" for p in obj.parameters() if "scopedlite" in type(p).__module__]
    return found


blocks = []
kept = []
for _block in range(3):
    with lite.launch(strategy=sys.argv[1], devices=2, accelerator="cpu", launcher="fork", timeout=60) as run:
        registry = run.strategy.set_up
        started_empty = registry.is_empty()
        torch.manual_seed(0)
        net = Net()
        model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        # built on an optimizer of its own: a scheduler sets the optimizer's `step` (torch's doing)
        other = torch.optim.SGD(net.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(other, step_size=1)
        model.score(torch.ones(2, 4))  # a user's method (under ZeRO-3 it gathers, counted per face)
        lite.backward(model(torch.ones(2, 4)).sum())
        opt.step()
        opt.zero_grad()
        during = from_every_rank(
            {
                "started_empty": started_empty,
                "models": [m is model for m in registry.models()],
                "site_known": registry.site_of(net) is not None and registry.site_of(model) is not None,
                "scheduler_known": registry.schedulers_of([other]) == [scheduler],
                "torch_inits_wrapped": not torch_inits_untouched(),
                "open_launches": len(this_process.open_launches.here()),
                "stop_requested": this_process.stop_request.is_set(),
                "blocks_entered": this_process.blocks_entered(),
                "holds_store": run.strategy.connection is not None and run.strategy.connection.store is not None,
            }
        )
    blocks.append(
        {
            "during": during,
            "empty_after": registry.is_empty(),
            "torch_inits_after": torch_inits_untouched(),
            "open_launches_after": len(this_process.open_launches.here()),
            "store_after": run.strategy.connection is not None or dist.is_initialized(),
            "ours_on_model": ours(model, built_by_setup=sys.argv[1] == "ddp"),
            "ours_on_user_module": ours(net),
            "ours_on_optimizer": ours(opt),
        }
    )
    kept.append((net, model, opt, scheduler))  # a notebook keeps them: the next block starts anyway
write(blocks)
