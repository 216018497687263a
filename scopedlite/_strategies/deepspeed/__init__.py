"""DeepSpeed ZeRO 1-3: the strategy, its config, its checkpoints, its log muting."""
