"""Distributed data parallel (``DistributedDataParallel``): the strategy, its side of
``lite.join``, and the user's own methods of a DDP model."""
