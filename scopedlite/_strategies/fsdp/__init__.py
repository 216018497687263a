"""FSDP2 (``fully_shard``): the strategy, its sharded init, its checkpoints."""
