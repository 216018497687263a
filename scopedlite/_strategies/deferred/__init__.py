"""Building a model without allocating it, then giving each tensor its plain-build value.

``tape.py`` records a build on the meta device; ``build.py`` replays one tensor at a time.
Shared by the sharding strategies' ``sharded_init`` (FSDP, DeepSpeed ZeRO-3).
"""
