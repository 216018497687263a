"""2D parallelism: the user's tensor-parallel plan times FSDP2 (``strategy="model_parallel"``)."""
