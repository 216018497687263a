"""XLA (TPU, XLA:CPU for testing): one-process and one-process-per-chip strategies."""
