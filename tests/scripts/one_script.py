"""One training script, unchanged under every strategy: the set-up model is the user's model.

argv: strategy checkpoint_dir

Runs on 2 CPU ranks (1 under ``single``, which reads both ranks' rows). Every step's batch of
8 rows is split by rank (rows ``rank::world_size``), so every strategy computes the same
averaged gradients and the test can compare the numbers across strategies. Rank 0 writes:

- what ``type()`` / ``isinstance`` give, the user's attribute and methods (with and without
  gradients, a method that calls forward and uses a root-level parameter), attribute writes;
- ``state_dict()`` keys and whether they load, strictly, into a plain ``Net()``;
- parameters after: two folds (a new model each, the old one dropped and released),
  accumulation with ``no_backward_sync``, clipping by norm (and the norm) and by value, a
  checkpoint round trip into a freshly set-up model, then one more step on each.

All parameters are read through ``model.state_dict()`` (full tensors of FSDP's DTensors).
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from functools import partial
from pathlib import Path

import torch

import scopedlite as lite
from _common import reductions_during, write
from _one_script_common import Net, WithConfig, build, global_batch, loss_of, probe, sgd

strategy, directory = sys.argv[1], Path(sys.argv[2])
devices = 1 if strategy == "single" else 2


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s batch of 8."""
    x, y = global_batch(step)
    run = lite.current()
    return x[run.global_rank :: run.world_size], y[run.global_rank :: run.world_size]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()}


def flat(model: torch.nn.Module) -> dict[str, list[float]]:
    return {k: v.float().flatten().tolist() for k, v in sorted(full_state(model).items())}


def grads(model: torch.nn.Module) -> list[list[float] | None]:
    """Each parameter's whole gradient (FSDP's gathered), in ``parameters()`` order."""
    full = [
        None if p.grad is None else p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for p in model.parameters()
    ]
    return [None if g is None else g.float().flatten().tolist() for g in full]


def train(model, opt, steps: int, start: int, accumulate: bool = False, max_norm=None, clip_val=None, reductions=None):
    """``reductions``, if given, receives per step the reducing collectives of the backward
    inside ``no_backward_sync`` and of the one after it."""
    norms = []
    for step in range(start, start + steps):
        x, y = batch(step)
        if accumulate:  # two micro-batches, synced on the second only
            half = len(x) // 2
            with lite.no_backward_sync(model):
                loss = loss_of(model, x[:half], y[:half])
                inside = reductions_during(partial(lite.backward, loss))
            loss = loss_of(model, x[half:], y[half:])
            after = reductions_during(partial(lite.backward, loss))
            if reductions is not None:
                reductions.append([inside, after])
        else:
            lite.backward(loss_of(model, x, y))
        if max_norm is not None:
            norms.append(float(lite.clip_gradients(model, opt, max_norm=max_norm)))
        if clip_val is not None:
            assert lite.clip_gradients(model, opt, clip_val=clip_val) is None
        opt.step()
        opt.zero_grad()
    return norms


result: dict = {"strategy": strategy}
with lite.launch(strategy=strategy, devices=devices, accelerator="cpu", timeout=120) as run:
    probe_x = probe()

    # -- attributes, methods, types ----------------------------------------------------------
    net = build(0)
    model, opt = lite.setup(net, sgd(net))
    result["type"] = type(model).__name__
    result["isinstance_user_class"] = isinstance(model, Net)
    result["gain"] = model.gain
    result["describe"] = model.describe()
    model.gain = 0.25  # written through to the module forward reads
    result["gain_seen_inside"] = model.current_gain()
    model.gain = 0.5
    with torch.no_grad():
        result["features_no_grad"] = model.features(probe_x).flatten().tolist()
        result["score_no_grad"] = model.score(probe_x).flatten().tolist()
    result["features_grad"] = model.features(probe_x).detach().flatten().tolist()
    try:
        model.no_such_attribute  # noqa: B018
        result["missing_attribute"] = "no error"
    except AttributeError as e:
        result["missing_attribute"] = str(e)

    # -- state dict keys load into the plain class ------------------------------------------
    plain = Net()
    result["state_dict_keys"] = sorted(model.state_dict())
    result["plain_keys"] = sorted(plain.state_dict())
    plain.load_state_dict(full_state(model))  # strict
    with torch.no_grad():
        result["plain_score"] = plain.score(probe_x).flatten().tolist()
    model.load_state_dict(model.state_dict())  # the set-up model takes its own state back
    if strategy in ("single", "ddp"):  # Fabric's `save(path, model.state_dict())`, one file
        lite.save(directory / "state_dict.pt", model.state_dict())
        result["saved_keys"] = sorted(lite.load(directory / "state_dict.pt"))

    # -- a new model per fold, the old one released -----------------------------------------
    result["folds"] = []
    for fold in range(2):
        net = build(10 + fold)
        fold_model, fold_opt = lite.setup(net, sgd(net))
        train(fold_model, fold_opt, steps=2, start=10 * fold)
        result["folds"].append(flat(fold_model))
        # The model, and what it holds (a parameter: under DeepSpeed the engine's), freed.
        released = [weakref.ref(fold_model), weakref.ref(next(fold_model.parameters()))]
        del net, fold_model, fold_opt
        gc.collect()
        result[f"fold_{fold}_released"] = [ref() is None for ref in released]

    # -- accumulation, clipping ---------------------------------------------------------------
    result["reductions"] = []
    train(model, opt, steps=2, start=20, accumulate=True, reductions=result["reductions"])
    result["after_accumulation"] = flat(model)
    result["norms"] = train(model, opt, steps=2, start=30, max_norm=0.05)
    result["after_clip_norm"] = flat(model)
    train(model, opt, steps=2, start=40, clip_val=0.01)
    result["after_clip_value"] = flat(model)

    # -- a loss that two trained models produced ------------------------------------------------
    net_a, net_b = build(20), build(21)
    model_a, opt_a = lite.setup(net_a, sgd(net_a))
    model_b, opt_b = lite.setup(net_b, sgd(net_b))
    x, y = batch(50)
    try:
        lite.backward(loss_of(model_a, x, y) + loss_of(model_b, x, y))
        result["ambiguous_backward"] = "no error"
        result["joint_grads"] = [grads(model_a), grads(model_b)]  # each model's own, averaged over the ranks
    except RuntimeError as e:
        result["ambiguous_backward"] = str(e)
    opt_a.zero_grad()
    opt_b.zero_grad()
    x, y = batch(51)
    lite.backward(loss_of(model_b, x, y), model=model_b)  # named: always fine
    opt_b.step()
    opt_b.zero_grad()
    x, y = batch(52)
    lite.backward(loss_of(model_a, x, y))  # found from the loss
    opt_a.step()
    opt_a.zero_grad()
    result["model_a"] = flat(model_a)
    result["model_b"] = flat(model_b)
    x, y = batch(53)
    try:  # model= names a model that was not set up: refused where it is used (DeepSpeed)
        lite.backward(loss_of(model_a, x, y), model=plain)
        result["backward_plain_model"] = "no error"
    except TypeError as e:
        result["backward_plain_model"] = str(e)
    opt_a.zero_grad()
    del model_a, model_b, opt_a, opt_b, net_a, net_b

    # -- checkpoint round trip into a freshly set-up model ------------------------------------
    path = directory / "ckpt"
    lite.save(path, {"model": model, "opt": opt, "step": 7})
    net = build(99)
    fresh, fresh_opt = lite.setup(net, sgd(net))
    rest = lite.load(path, {"model": fresh, "opt": fresh_opt})
    result["loaded_rest"] = rest
    result["loaded_equal"] = flat(fresh) == flat(model)
    train(model, opt, steps=1, start=60)
    train(fresh, fresh_opt, steps=1, start=60)
    result["after_resume"] = flat(model)
    result["fresh_after_resume"] = flat(fresh)

    # -- two backward passes before a step, without no_backward_sync ---------------------------
    x, y = batch(70)
    lite.backward(loss_of(model, x, y))
    try:
        lite.backward(loss_of(model, x, y))
        result["second_backward"] = "no error"
    except RuntimeError as e:
        result["second_backward"] = str(e)

    # -- a user attribute the wrapper has a name of its own for ------------------------------
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = WithConfig()
        shadowing, _ = lite.setup(net, sgd(net))  # ZeRO 1/2 refuse a model without optimizer
    result["config_is_users"] = shadowing.config == {"depth": 2}
    try:  # a model without optimizer: an engine for evaluation, except at ZeRO 1/2
        lite.setup(build(30))
        result["setup_without_optimizer"] = "no error"
    except ValueError as e:
        result["setup_without_optimizer"] = str(e)
    result["shadow_warnings"] = [str(w.message) for w in caught if "config" in str(w.message)]

    if run.is_global_zero:
        write(result)
