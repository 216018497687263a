"""Private API of torch, DeepSpeed and torch_xla, fenced: one module per library, each use
with its reason and the version it was checked against. Nothing outside this package
reaches into those libraries' internals."""
