"""A rank that skips a backward the others run, inside lite.join (data-dependent control flow:
`if not torch.isfinite(loss): continue`), on a plain list of batches.

argv: strategy

- ``middle``: rank 1 skips the backward of its 4th batch and goes on: every rank refuses at
  once with the same message (none waits in the others' gradient collectives), and the next
  collective after the block still pairs.
- ``eval``: rank 0 alone evaluates (a forward without gradients) in the middle of the loop:
  every rank refuses at once, the message telling the two forwards apart.
- ``step`` (DeepSpeed, whose optimizer step is collective): rank 1 runs the backward and skips
  the step the others take: both raise (none waits in the others' step), and the next
  collective pairs.
- ``raises``: rank 1's forward raises inside the model (after its round, before its outputs
  exist) while the others go on to that forward's backward: rank 1 gets its error, the others
  PeerLeftJoinError (none waits in a gradient collective), and the next collective pairs.
- ``save``: rank 0 alone saves ``model.state_dict()`` in the middle of the loop: where that
  is local (ddp, fsdp's DTensor shards, ZeRO-1/2) it runs; under ZeRO-3, where it gathers,
  it is refused on rank 0 before it gathers, the others get PeerLeftJoinError, and the next
  collective pairs (before, gloo aborted the process on a size mismatch).
- ``last``: rank 1 skips the backward of its last batch and leaves the loop: it contributes
  zero to that step, as a rank out of data does; the parameters end equal on both ranks and
  equal to plain torch's over the same losses (a missing rank counts zero, the mean over 2).
"""

import io
import sys

import torch

import scopedlite as lite
from _common import from_every_rank, make_model, params, write

strategy = sys.argv[1]
LR = 0.1


def data(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(8, 4, generator=g) for _ in range(n)]


def reference(skipped: dict[int, set[int]], lengths: dict[int, int]) -> list[list[float]]:
    """Plain torch, one process: each step's loss is the sum of the ranks' losses that ran a
    backward, over the world size (divide_by_initial_world_size=True)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = {r: data(r, n) for r, n in lengths.items()}
    for step in range(max(lengths.values())):
        losses = [
            model(batches[r][step]).pow(2).mean() for r in lengths if step < lengths[r] and step not in skipped[r]
        ]
        (sum(losses) / len(lengths)).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


class Raising(torch.nn.Module):
    """The test's model, whose forward raises on rank 1 at its 4th call (an OOM, a bad batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if lite.current().global_rank == 1 and self.calls == 4:
            raise KeyError("rank 1 fails inside its forward")
        return self.inner(x)


result = {}
with lite.launch(strategy=strategy, devices=2, accelerator="cpu", timeout=300) as run:
    rank = run.global_rank
    cases = [
        ("middle", {0: 6, 1: 6}, 3),
        ("eval", {0: 6, 1: 6}, -1),
        ("raises", {0: 6, 1: 6}, -1),
        ("last", {0: 6, 1: 4}, 3),
        ("save", {0: 6, 1: 6}, -1),
    ]
    if strategy.startswith("deepspeed"):
        cases.append(("step", {0: 6, 1: 6}, 3))
    for case, lengths, skip_at in cases:
        model = Raising() if case == "raises" else make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = lite.setup(model, opt)
        try:
            with lite.join(model):
                for i, x in enumerate(data(rank, lengths[rank])):
                    loss = model(x).pow(2).mean()
                    if rank == 1 and i == skip_at and case != "step":
                        continue  # this rank alone skips the step
                    lite.backward(loss)
                    if rank == 1 and i == skip_at:
                        continue  # this rank alone skips its optimizer step
                    opt.step()
                    opt.zero_grad()
                    if case == "eval" and rank == 0 and i == 3:
                        with torch.no_grad():
                            model(x)  # rank 0 alone peeks at its model
                    if case == "save" and rank == 0 and i == 3:
                        torch.save(model.state_dict(), io.BytesIO())  # rank 0 alone saves mid-epoch
            result[case] = {"error": None}
        except (RuntimeError, KeyError) as e:
            result[case] = {"error": f"{type(e).__name__}: {e}"}
        result[case]["after"] = float(lite.all_reduce(torch.tensor(float(rank + 1)), op="sum"))
        if case == "last":
            full = [
                (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                for p in model.parameters()
            ]
            result[case]["params"] = from_every_rank(full)
            result[case]["reference"] = reference({0: set(), 1: {skip_at}}, lengths)
    everyone = from_every_rank(result)
write(everyone)
