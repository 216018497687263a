"""HSDP: FSDP2 sharding within groups of ranks and replicating across them.

``FSDPStrategy(replicate_degree=R)`` arranges the W processes in a ``DeviceMesh`` of shape
``(R, W // R)`` with dimensions ``"replicate"`` and ``"shard"``: rank ``r`` is in replica
``r // (W // R)`` and holds shard ``r % (W // R)`` of it. ``fully_shard`` over that mesh
all-gathers parameters and reduce-scatters gradients within a replica (consecutive ranks: one
node, where the links are fast) and all-reduces the reduced shards across the replicas (one
collective per unit and step over the slower links). The result is FSDP's over the whole
world: every rank reads its own share of the data and the gradient is the mean over all W
ranks, so everything else (loaders, ``join``, checkpoints) is plain FSDP's.
"""

from __future__ import annotations

import math

__all__ = ["REPLICATE", "SHARD", "check_replicate_degree", "hsdp_shape", "square_divisor"]

REPLICATE = "replicate"
SHARD = "shard"


def check_replicate_degree(value: object) -> int | str:
    """``replicate_degree`` as given: a positive number of replicas or ``"auto"``."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value  # type: ignore[return-value]
    raise ValueError(
        f"FSDPStrategy(replicate_degree={value!r}) is not valid: pass a positive number of "
        "replicas that divides the world size (1: plain FSDP, every rank a shard of one "
        "replica), or 'auto' (one replica per node, sharded over that node's processes)."
    )


def hsdp_shape(replicate_degree: int | str, world_size: int, per_node: int) -> tuple[int, int]:
    """The mesh ``(replicate, shard)`` of a world of ``world_size`` processes, ``per_node`` on
    each node; ``"auto"`` is one replica per node. A degree that does not divide the world
    size is refused, naming the ones that do."""
    if replicate_degree == "auto":
        if world_size % per_node:
            raise ValueError(
                f"FSDPStrategy(replicate_degree='auto') makes one replica per node, but the "
                f"run's {world_size} processes are not a whole number of nodes of {per_node}. "
                "Pass the number of replicas: FSDPStrategy(replicate_degree=N)."
            )
        return world_size // per_node, per_node
    degree = int(replicate_degree)
    if world_size % degree:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        example = square_divisor(world_size)
        raise ValueError(
            f"FSDPStrategy(replicate_degree={degree}) does not fit a run of {world_size} "
            f"processes: the number of replicas must divide the world size, each replica "
            f"sharded over the same number of processes. Choose one of {divisors}, e.g. "
            f"FSDPStrategy(replicate_degree={example}) ({example} replicas of "
            f"{world_size // example} shards), or change devices=."
        )
    return degree, world_size // degree


def square_divisor(n: int) -> int:
    """A suggestion for a 2D mesh of ``n`` processes: the largest divisor of ``n`` not above
    its square root (also ``model_parallel``'s)."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
