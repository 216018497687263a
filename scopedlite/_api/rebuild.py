"""Rebuilding a ``DataLoader`` around our sampler: at setup, and for one resumed pass."""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from scopedlite._api.sampler import ShardedBatchSampler, ShardedSampler
from scopedlite._api.seed import SeedWorker

__all__ = ["loader_arguments", "refuse_unrebuildable", "shard_loader"]

# DataLoader arguments carried over when a loader is rebuilt (around our sampler at setup,
# around a resumed pass in loader_state).
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


def loader_arguments(loader: DataLoader) -> dict[str, Any]:  # type: ignore[type-arg]
    """The arguments ``loader`` was built with that a rebuilt copy of it keeps."""
    kwargs = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def refuse_unrebuildable(loader: DataLoader) -> None:  # type: ignore[type-arg]
    """Raise ``TypeError`` for a loader that cannot be rebuilt faithfully, naming the fix."""
    if type(loader) is not DataLoader:
        raise TypeError(
            f"setup_dataloader rebuilds the loader around a distributed sampler and cannot "
            f"rebuild a {type(loader).__name__} (a DataLoader subclass) faithfully. Pass a "
            "plain torch.utils.data.DataLoader, or shard it yourself (e.g. with "
            "lite.ShardedSampler(sampler, run.data_parallel_rank, run.data_parallel_size)) and call "
            "setup_dataloader(loader, use_distributed_sampler=False)."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "setup_dataloader cannot shard an IterableDataset: it has no indices to deal out, "
            "so every rank would read the whole stream. Make the dataset yield this rank's "
            "share itself (lite.current().data_parallel_rank of .data_parallel_size), then call "
            "setup_dataloader(loader, use_distributed_sampler=False)."
        )


def _already_sharded(sampler: Any) -> bool:
    """A ``DistributedSampler`` subclass shards by itself in a way we cannot read: kept as it
    is. (A plain ``DistributedSampler`` is taken over by :class:`ShardedSampler` instead.)"""
    return isinstance(sampler, DistributedSampler) and type(sampler) is not DistributedSampler


def _carried(loader: DataLoader, rank: int) -> dict[str, Any]:  # type: ignore[type-arg]
    """The loader's own arguments, with workers seeded per rank (see :class:`SeedWorker`)."""
    kwargs = loader_arguments(loader)
    if loader.num_workers > 0:
        kwargs["worker_init_fn"] = SeedWorker(rank, loader.worker_init_fn)
    return kwargs


def shard_loader(loader: DataLoader, rank: int, world_size: int, seed: int) -> DataLoader:  # type: ignore[type-arg]
    """A copy of ``loader`` that reads rank ``rank``'s share of each pass (see ``sampler``)."""
    kwargs = _carried(loader, rank)
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the loader yields single samples
        sampler = loader.sampler
        if not _already_sharded(sampler):
            sampler = ShardedSampler(sampler, rank, world_size, seed)  # type: ignore[arg-type]
        return DataLoader(loader.dataset, batch_size=None, sampler=sampler, **kwargs)
    inner = getattr(batch_sampler, "sampler", None)
    if type(batch_sampler) is BatchSampler:
        if not _already_sharded(inner):
            inner = ShardedSampler(inner, rank, world_size, seed)  # type: ignore[arg-type]
        return DataLoader(
            loader.dataset,
            batch_size=batch_sampler.batch_size,
            drop_last=batch_sampler.drop_last,
            sampler=inner,
            **kwargs,
        )
    if not isinstance(inner, DistributedSampler):
        batch_sampler = ShardedBatchSampler(batch_sampler, rank, world_size, seed)  # type: ignore[arg-type]
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)
