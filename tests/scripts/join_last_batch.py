"""What scripts do on a rank's own last batch inside lite.join, where the ranks' last batches
come at different steps (a set-up loader of 21 samples, batch 2: 6 batches on rank 0, 5 on
rank 1).

argv: strategy

- ``window_ends_at_own_last``: an accumulation window that ends at each rank's own last batch
  (``i == len(loader) - 1``, as HF Accelerate's ``accumulate`` syncs at the end of the loader):
  rank 1 synchronises its 5th backward while rank 0 runs it inside ``no_backward_sync``. Over
  the set-up loader and over a plain list of the same batches: every rank refuses at once,
  naming the fix, and the next collective pairs (before, rank 1 waited in its gradient
  all-reduce alone until the timeout, or gloo aborted it).
- ``epoch_end_log``: ``lite.all_reduce(loss)`` at ``i == len(loader) - 1`` inside the loop
  (an end-of-epoch log): refused on every rank, naming the fix (before, over the set-up loader,
  rank 1's all-reduce waited for rank 0, which was in the round of its 6th batch, until the
  timeout).
- ``window_by_step``: the fix the refusal names, windows of 2 ended by the step count alone:
  rank 1's last batch, in an open window when it runs out, is contributed at rank 0's next
  synchronising backward. Writes each rank's parameters and batches; the test compares them
  with plain torch.
- ``window_by_step_forward_outside``: the same over a plain list, with each forward outside
  ``no_backward_sync`` and only the backward inside: DDP decides in the forward, so it
  synchronises every backward all the same (before, the session took the backward's flag and
  rank 1 replayed rank 0's last forward without preparing the all-reduce rank 0 was in: a hang;
  and a rank out of data brought zero to a window's later all-reduce, where the running rank
  brings the window's average again); FSDP and DeepSpeed decide in the backward and
  accumulate. The same parameters either way.
- ``break_together``: every rank peeks at a batch, then leaves its loop at the same batch (a
  step limit) while all run free, and calls a collective after the loop: a left pass starts
  the rounds on every rank alike; the parameters are plain torch's over those 3 steps.
"""

import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_data, make_model, write

strategy = sys.argv[1]
LR = 0.1


def train(loader, case: str, seen: list) -> None:
    if case == "break_together":
        next(iter(loader))  # every rank peeks at a batch first (a shape to build from)
    n = len(loader)
    for i, (x, y) in enumerate(loader):
        seen.append([x.tolist(), y.tolist()])
        if case == "break_together":
            lite.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            if i == 2:
                break  # every rank, at the same batch (a step limit)
            continue
        if case == "epoch_end_log":
            loss = torch.nn.functional.mse_loss(model(x), y)
            lite.backward(loss)
            opt.step()
            opt.zero_grad()
            if i == n - 1:
                lite.all_reduce(loss.detach())
            continue
        by_step = case.startswith("window_by_step")
        sync = (i + 1) % (2 if by_step else 4) == 0 or (not by_step and i == n - 1)
        outside = case == "window_by_step_forward_outside"
        loss = torch.nn.functional.mse_loss(model(x), y) if outside else None
        with lite.no_backward_sync(model, enabled=not sync):
            if not outside:
                loss = torch.nn.functional.mse_loss(model(x), y)
            lite.backward(loss)
        if sync:
            opt.step()
            opt.zero_grad()


result = {}
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=60) as run:
    rank = run.global_rank
    for case, plain in [
        ("window_ends_at_own_last", False),
        ("window_ends_at_own_last", True),
        ("epoch_end_log", False),
        ("window_by_step", False),
        ("window_by_step_forward_outside", True),
        ("break_together", False),
    ]:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = lite.setup(model, opt)
        loader = lite.setup_dataloader(torch.utils.data.DataLoader(make_data(21), batch_size=2))
        name = case + ("_list" if plain else "")
        seen = []
        try:
            with lite.join(model):
                if plain:
                    loader = list(loader)  # this rank's exact share inside the block
                train(loader, case, seen)
                if case == "break_together":
                    lite.all_reduce(torch.tensor(1.0))  # after the loop, inside the block
            result[name] = {"error": None}
        except RuntimeError as e:
            result[name] = {"error": str(e)}
        result[name]["after"] = float(lite.all_reduce(torch.tensor(float(rank + 1)), op="sum"))
        if case.startswith("window_by_step") or case == "break_together":
            full = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]
            result[name]["params"] = [p.flatten().tolist() for p in full]
            result[name]["batches"] = seen
    everyone = from_every_rank(result)
write(everyone)
