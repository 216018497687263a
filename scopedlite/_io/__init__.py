"""Checkpoint file I/O below the strategies: atomic writes, safe reads, restoring state,
consolidating a sharded folder into one file."""
