"""The user's own methods on some ranks or all, under one strategy; one launch, 2 CPU ranks.

argv: strategy (ddp | fsdp | deepspeed_stage_2 | deepspeed_stage_3)

- ddp: issue 29's minimal form. A Net with ``num_params()`` (no forward), ``score(x)`` (a
  forward with gradients on, never back-propagated) and ``loss(x, y)`` (back-propagated);
  each step two micro-batches, the first inside ``lite.no_backward_sync``. Phases, each on a
  fresh model with a comm hook that counts DDP's gradient all-reduces per micro-step:
  ``rank0`` (rank 0 alone calls ``num_params`` and ``score`` after each step), ``all`` (every
  rank does), ``method_loss`` (the loss is ``model.loss(x, y)``), ``mixed`` (forward's loss
  plus a method's, one backward); then, inside ``lite.join``, a method's result back-propagated
  (refused on every rank) and forward's loss (trains).
- every strategy but ZeRO-3: nanoGPT's loop (examples/nanogpt.py: ``estimate_mfu`` on rank 0
  only, accumulation, clipping), then again inside ``lite.join``.
- fsdp and ZeRO-3: the parameter count read on rank 0 alone, and ``get_num_params()`` and
  ``estimate_mfu`` on every rank, are the whole model's (ZeRO-3's partitioned parameters
  counted 0); ``generate`` (a method that gathers) on every rank works, on rank 0 only
  is refused naming it and the ranks, and inside ``lite.join`` is refused; the run goes on.

Rank 0 writes parameters (full values), logged losses, counts and messages; the test compares
them with one-process references it computes with plain torch.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import nanogpt
import scopedlite as lite
from _common import NetWithMethods, micro_batch, write

strategy = sys.argv[1]
STEPS = 3


def full_state(model: torch.nn.Module) -> dict[str, list[float]]:
    state = model.state_dict()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
    return {k: v.detach().float().flatten().tolist() for k, v in sorted(full.items())}


def same_on_every_rank(model: torch.nn.Module) -> bool:
    flat = torch.cat([torch.tensor(v) for v in full_state(model).values()])
    gathered = lite.all_gather(flat)
    return bool((gathered == gathered[0]).all())


def ddp_phase(phase: str, run: lite.Run) -> dict:
    torch.manual_seed(0)
    net = NetWithMethods()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    calls = [0]

    def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks real annotations)
        calls[0] += 1
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting)
    probe = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    per_micro = []
    counted = []
    for step in range(STEPS):
        for micro in range(2):
            x, y = micro_batch(step, run.global_rank, micro)
            before = calls[0]
            with lite.no_backward_sync(model, enabled=micro == 0):
                if phase == "method_loss":
                    loss = model.loss(x, y)
                elif phase == "mixed":  # forward's output and a method's result in one loss
                    loss = 0.5 * torch.nn.functional.mse_loss(model(x), y) + 0.5 * model.loss(x, y)
                else:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                lite.backward(loss)
            per_micro.append(calls[0] - before)
        opt.step()
        opt.zero_grad()
        if phase == "all" or (phase == "rank0" and run.is_global_zero):
            counted.append(model.num_params())
            model.score(probe)  # a forward with gradients on, never back-propagated
    return {
        "params": full_state(model),
        "same": same_on_every_rank(model),
        "all_reduces": per_micro,
        "counted": counted,
    }


def ddp_backward_of_a_method_in_join(run: lite.Run) -> dict:
    """Inside lite.join a method's result cannot be back-propagated (ranks out of data replay
    forwards): refused on every rank before anything is reduced; forward's loss still trains."""
    torch.manual_seed(0)
    net = NetWithMethods()
    model, opt = lite.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = micro_batch(0, run.global_rank, 0)
    with lite.join(model):
        try:
            lite.backward(model.loss(x, y))
            message = "no error"
        except RuntimeError as e:
            message = str(e)
        lite.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return {"message": message, "params": full_state(model), "same": same_on_every_rank(model)}


def nanogpt_runs() -> dict:
    # clipping at 0.3: every step's gradient norm is above it (0.34-0.78; nanoGPT's 1.0 is never active here)
    args = nanogpt.arguments(["--max-iters", "7", "--gradient-accumulation-steps", "2", "--grad-clip", "0.3"])
    data = nanogpt.token_stream(4000)
    result = {}
    for joined in (False, True):
        model, optimizer = nanogpt.build(args)
        model, optimizer = lite.setup(model, optimizer)
        with lite.join(model) if joined else contextlib.nullcontext():
            losses = nanogpt.train(model, optimizer, data, args)
        key = "join" if joined else "plain"
        result[key] = {"params": full_state(model), "same": same_on_every_rank(model), "losses": losses}
    return result


def gathering_method(run: lite.Run) -> dict:
    """``generate`` needs the gathered parameters: every rank, rank 0 alone, inside join."""
    args = nanogpt.arguments([])
    model, optimizer = nanogpt.build(args)
    model, optimizer = lite.setup(model, optimizer)
    # parameter counts: a plain read on rank 0 alone, a method (estimate_mfu's) on every rank
    counted = sum(p.numel() for p in model.parameters()) if run.is_global_zero else None
    result = {"counted": counted, "num_params": model.get_num_params(), "mfu": model.estimate_mfu(1, 1.0)}
    prompt = lite.to_device(torch.tensor([[1, 8, 11]]))
    tokens = model.generate(prompt, 4)
    gathered = lite.all_gather(tokens)
    result |= {"every_rank": tokens.tolist(), "every_rank_same": bool((gathered == gathered[0]).all())}
    result["rank0_alone"] = "no error"
    if run.is_global_zero:
        try:
            model.generate(prompt, 4)
        except RuntimeError as e:
            result["rank0_alone"] = f"{type(e).__name__}: {e}"
    x, y = nanogpt.get_batch(nanogpt.token_stream(200), torch.Generator().manual_seed(run.global_rank), 2, 8)
    _, loss = model(x, y)  # rank 1 went on to this forward; rank 0 meets it after its refusal
    lite.backward(loss)
    with lite.join(model):
        try:
            model.generate(prompt, 1)
            result["in_join"] = "no error"
        except RuntimeError as e:
            result["in_join"] = str(e)
        _, loss = model(x, y)
        lite.backward(loss)
    result["same_after"] = same_on_every_rank(model)
    return result


with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    out: dict = {"strategy": strategy}
    if strategy == "ddp":
        out["ddp"] = {phase: ddp_phase(phase, run) for phase in ("rank0", "all", "method_loss", "mixed")}
        out["ddp_join"] = ddp_backward_of_a_method_in_join(run)
    if strategy != "deepspeed_stage_3":
        out["nanogpt"] = nanogpt_runs()
    if strategy in ("fsdp", "deepspeed_stage_3"):
        out["gathering"] = gathering_method(run)
    if run.is_global_zero:
        write(out)
