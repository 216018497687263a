"""Epoch time on uneven shards: ``lite.join`` (each sample once) vs the padded sampler.

argv: OUT SAMPLES BATCH EPOCHS DEVICES. With 1000 samples on 3 ranks and batch 1, join gives
rank 0 334 batches and ranks 1-2 333 each; outside join the sampler pads every rank to 334
(1002 samples, two of them twice). A third mode runs torch's own
``torch.distributed.algorithms.join.Join([model])`` over the same strided shards, to tell
torch's per-step join cost apart from scopedlite's. Modes rotate from epoch to epoch. An
epoch is timed on rank 0 between two barriers (join entry and exit included), so it lasts
until the slowest rank is done. Rank 0 writes epoch times and the samples each rank saw.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable

import torch
from torch.distributed.algorithms.join import Join

import scopedlite as lite
from workload import make_dataset, make_model, make_optimizer, write_result

out, samples, batch, epochs, devices = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
    int(sys.argv[5]),
)
MODES = ("padded", "join", "torch_join")


class Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Yields the sample's index too, so we can check what each mode really covers."""

    def __init__(self, n: int) -> None:
        self.data = make_dataset(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return i, x, y


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Iterable[tuple[torch.Tensor, ...]]) -> list[int]:
    seen: list[int] = []
    for idx, x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        lite.backward(loss)
        opt.step()
        opt.zero_grad()
        seen += idx.tolist()
    return seen


with lite.launch(strategy="ddp", devices=devices, accelerator="cpu") as run:
    dataset = Indexed(samples)
    model = make_model()
    model, opt = lite.setup(model, make_optimizer(model))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(dataset, batch_size=batch))
    # What lite.join's sampler gives this rank (r, r + w, ...), as a plain torch loader.
    shard = torch.utils.data.Subset(dataset, range(run.global_rank, samples, run.world_size))
    torch_loader = torch.utils.data.DataLoader(shard, batch_size=batch)

    record: dict[str, list[float]] = {mode: [] for mode in MODES}
    seen_by_mode: dict[str, list[list[int]]] = {}
    for e in range(epochs):
        for mode in MODES[e % 3 :] + MODES[: e % 3]:
            lite.barrier()
            start = time.perf_counter()
            if mode == "join":
                with lite.join(model):
                    seen = train(model, opt, loader)
            elif mode == "torch_join":
                with Join([model]):
                    seen = train(model, opt, torch_loader)
            else:
                seen = train(model, opt, loader)
            lite.barrier()
            record[mode].append(time.perf_counter() - start)
            if mode not in seen_by_mode:
                seen_by_mode[mode] = [lite.broadcast(seen, src=r) for r in range(run.world_size)]
    if run.is_global_zero:
        write_result(out, {"epoch_s": record, "seen": seen_by_mode})
