"""What the join session refuses under a sharded strategy, each with its reason.

argv: strategy case
  case "batched": every refusal that all ranks meet together, one after another, in one run;
  then a rank leaving the block by an exception at several points (while the other rank
  replays, mid-step, while both run, and the rank out of data itself), each followed by a
  collective after the block; rank 0 writes each rank's error messages and values.
  case "sched_after_loop": an LR scheduler stepped after the loop inside the block on uneven
  data; the run must end with the error, not hang.
"""

import sys

import torch

import scopedlite as lite
from _common import make_model, write

name, case = sys.argv[1], sys.argv[2]


def error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "not refused"


with lite.launch(
    strategy=name, devices=2, accelerator="cpu", timeout=300
) as run:  # a hang: the test's 90 s kill, long before
    rank = run.global_rank
    model = make_model()
    model, opt = lite.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(2, 4), torch.randn(2, 1)

    def step() -> None:
        lite.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    if case == "sched_after_loop":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        with lite.join(model):
            for _ in range(3 if rank == 0 else 1):
                step()
            sched.step()  # runs early on rank 1: refused when rank 1 starts serving
        sys.exit("not refused")

    def plain() -> None:
        with lite.join(torch.nn.Linear(4, 1)):
            pass

    def lr_by_hand() -> None:
        with lite.join(model):
            step()
            opt.param_groups[0]["lr"] = 0.5
            step()

    def disagree() -> None:  # data-dependent control flow: ranks announce different things
        with lite.join(model):
            if rank == 0:
                lite.all_reduce(1)
            else:
                model(x)

    def plateau() -> None:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        with lite.join(model):
            step()
            sched.step(1.0)

    def unknown_optimizer() -> None:
        with lite.join(model):
            lite.backward(torch.nn.functional.mse_loss(model(x), y))
            lite.clip_gradients(model, torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)

    def two_forwards() -> None:  # one loss from two forwards: a joined rank cannot replay it
        with lite.join(model):
            loss = torch.nn.functional.mse_loss(model(x[:1]), y[:1]) + torch.nn.functional.mse_loss(model(x[1:]), y[1:])
            lite.backward(loss)

    # -- a rank leaves the block by an exception (rank 0 has 3 steps, rank 1 one) ----------------
    def abort(raiser: int, where: str) -> None:
        with lite.join(model):
            for i in range(3 if rank == 0 else 1) if where != "both_run" else range(2):
                if where == "replaying" and rank == raiser and i == 2:  # rank 1 replays since step 1
                    raise KeyError(f"rank {rank} fails while rank 1 replays")
                out = model(x)
                if where in ("mid_step", "both_run") and rank == raiser and i == (2 if where == "mid_step" else 1):
                    raise KeyError(f"rank {rank} fails between its forward and its backward")
                lite.backward(torch.nn.functional.mse_loss(out, y))
                opt.step()
                opt.zero_grad()
            if where == "out_of_data" and rank == raiser:  # rank 1, after its loop, while rank 0 runs
                raise KeyError(f"rank {rank} fails after its loop, inside the block")

    def left(raiser: int, where: str) -> dict:
        try:
            abort(raiser, where)
            outcome = "no error"
        except (KeyError, RuntimeError) as e:  # PeerLeftJoinError is a RuntimeError
            outcome = f"{type(e).__name__}: {e}"
        opt.zero_grad()
        return {"error": outcome, "after": lite.all_reduce(float(rank + 1))}  # still a pair: 1 + 2

    aborts = {
        "replaying": left(0, "replaying"),
        "mid_step": left(0, "mid_step"),
        "both_run": left(1, "both_run"),
        "out_of_data": left(1, "out_of_data"),
    }

    cases = {
        "plain": plain,
        "lr_by_hand": lr_by_hand,
        "disagree": disagree,
        "plateau": plateau,
        "two_forwards": two_forwards,
    }
    cases["unknown_optimizer"] = unknown_optimizer
    errors = {key: error(fn) for key, fn in cases.items()}
    opt.zero_grad()
    with lite.join(model):  # the session still works after all that
        step()
    errors["after"] = lite.all_reduce(1)
    errors["aborts"] = aborts
    everyone = [lite.broadcast(errors, src=r) for r in range(run.world_size)]
    if rank == 0:
        write(everyone)
