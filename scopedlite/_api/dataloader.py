"""``lite.setup_dataloader``: shard a loader across ranks and move its batches to the device."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from scopedlite._api.current import current
from scopedlite._api.sampler import ShardedBatchSampler, ShardedSampler
from scopedlite._api.seed import current_seed
from scopedlite._core.structures import map_tensors
from scopedlite._strategies.abilities import SupportsDeviceFeed

__all__ = ["DeviceDataLoader", "setup_dataloader"]

# DataLoader arguments carried over when the loader is rebuilt around our sampler.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class DeviceDataLoader:
    """A loader whose batches arrive on the run's device, with the epoch advanced per pass.

    Attribute access falls through to the wrapped ``DataLoader`` (``dataset``,
    ``batch_size``, ``sampler``, ...). ``len()`` reads the scope: inside ``lite.join`` it is
    this rank's exact number of batches, outside the padded one.
    """

    def __init__(
        self,
        loader: DataLoader,  # type: ignore[type-arg]
        device: torch.device | None,
        feed: Callable[[Iterable[Any]], Iterator[Any]] | None = None,
    ) -> None:
        self.loader = loader
        self.device = device
        self.feed = feed  # the strategy's own way to the device (XLA's MpDeviceLoader)
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass (it then advances by one per pass)."""
        self._epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        for sampler in (self.loader.sampler, self.loader.batch_sampler):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self._epoch)
        self._epoch += 1
        if self.feed is not None:
            yield from self.feed(self.loader)
            return
        device = self.device
        non_blocking = device is not None and device.type == "cuda"
        for batch in self.loader:
            if device is not None:
                batch = map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def _shard_loader(loader: DataLoader, rank: int, world_size: int, seed: int) -> DataLoader:  # type: ignore[type-arg]
    if type(loader) is not DataLoader:
        raise TypeError(
            f"setup_dataloader rebuilds the loader around a distributed sampler and cannot "
            f"rebuild a {type(loader).__name__} (a DataLoader subclass) faithfully. Pass a "
            "plain torch.utils.data.DataLoader, or shard it yourself (e.g. with "
            "lite.ShardedSampler(sampler, run.global_rank, run.world_size)) and call "
            "setup_dataloader(loader, use_distributed_sampler=False)."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "setup_dataloader cannot shard an IterableDataset: it has no indices to deal out, "
            "so every rank would read the whole stream. Make the dataset yield this rank's "
            "share itself (lite.current().global_rank / world_size), then call "
            "setup_dataloader(loader, use_distributed_sampler=False)."
        )
    kwargs = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is BatchSampler:
        sampler = ShardedSampler(batch_sampler.sampler, rank, world_size, seed)  # type: ignore[arg-type]
        return DataLoader(
            loader.dataset,
            batch_size=batch_sampler.batch_size,
            drop_last=batch_sampler.drop_last,
            sampler=sampler,
            **kwargs,
        )
    if batch_sampler is not None:
        sharded = ShardedBatchSampler(batch_sampler, rank, world_size, seed)  # type: ignore[arg-type]
        return DataLoader(loader.dataset, batch_sampler=sharded, **kwargs)
    # batch_size=None: the loader yields single samples
    sampler = ShardedSampler(loader.sampler, rank, world_size, seed)  # type: ignore[arg-type]
    return DataLoader(loader.dataset, batch_size=None, sampler=sampler, **kwargs)


def setup_dataloader(
    *loaders: DataLoader,  # type: ignore[type-arg]
    use_distributed_sampler: bool = True,
    move_to_device: bool = True,
) -> Any:
    """Prepare loaders for the active run: shard them across ranks, move batches to the device.

    The loader's own sampler is kept and sharded (see :class:`ShardedSampler`): padded to
    even counts outside ``lite.join``, exact inside it. The shuffle seed is the
    ``seed_everything`` seed (0 if never called) and the epoch advances each time the loader
    is iterated, so shuffling differs per epoch and matches across ranks.

    Returns:
        One loader, or a tuple when several are given.
    """
    if not loaders:
        raise TypeError("setup_dataloader needs at least one DataLoader: `lite.setup_dataloader(loader)`.")
    run = current()
    prepared = []
    for loader in loaders:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"setup_dataloader takes torch DataLoaders, got {type(loader).__name__}.")
        if use_distributed_sampler and run.world_size > 1:
            loader = _shard_loader(loader, run.global_rank, run.world_size, current_seed())
        strategy = run.strategy
        feed = strategy.device_batches if move_to_device and isinstance(strategy, SupportsDeviceFeed) else None
        prepared.append(DeviceDataLoader(loader, run.device if move_to_device else None, feed))
    return prepared[0] if len(prepared) == 1 else tuple(prepared)
