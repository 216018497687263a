"""Epoch time on uneven shards: ``lite.join`` (each sample once) vs the padded sampler.

argv: OUT SAMPLES BATCH EPOCHS DEVICES. With 1000 samples on 3 ranks and batch 1, join gives
rank 0 334 batches and ranks 1-2 333 each; outside join the sampler pads every rank to 334
(1002 samples, two of them twice). Epochs alternate padded/join (ABBA...). An epoch is timed
on rank 0 between two barriers, so it lasts until the slowest rank is done. Rank 0 writes the
epoch times and, per mode, which samples every rank saw, to OUT.
"""

from __future__ import annotations

import sys
import time

import torch

import scopedlite as lite
from workload import make_dataset, make_model, make_optimizer, write_result

out, samples, batch, epochs, devices = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])


class Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Yields the sample's index too, so we can check what each mode really covers."""

    def __init__(self, n: int) -> None:
        self.data = make_dataset(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return i, x, y


def epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, loader: object) -> tuple[float, list[int]]:
    seen: list[int] = []
    lite.barrier()
    start = time.perf_counter()
    for idx, x, y in loader:  # type: ignore[attr-defined]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        lite.backward(loss)
        opt.step()
        opt.zero_grad()
        seen += idx.tolist()
    return start, seen


with lite.launch(strategy="ddp", devices=devices, accelerator="cpu") as run:
    model = make_model()
    model, opt = lite.setup(model, make_optimizer(model))
    loader = lite.setup_dataloader(torch.utils.data.DataLoader(Indexed(samples), batch_size=batch))
    record: dict[str, list[float]] = {"padded": [], "join": []}
    seen_by_mode: dict[str, list[list[int]]] = {}
    for e in range(epochs):
        order = ("padded", "join") if e % 2 == 0 else ("join", "padded")
        for mode in order:
            if mode == "join":
                with lite.join(model):
                    start, seen = epoch(model, opt, loader)
            else:
                start, seen = epoch(model, opt, loader)
            lite.barrier()
            record[mode].append(time.perf_counter() - start)
            if mode not in seen_by_mode:
                seen_by_mode[mode] = [lite.broadcast(seen, src=r) for r in range(run.world_size)]
    if run.is_global_zero:
        write_result(out, {"epoch_s": record, "seen": seen_by_mode})
