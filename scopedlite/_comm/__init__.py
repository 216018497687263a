"""Communication plumbing below the strategies: process groups and their store, the wire
format of our collectives (``distributed``: process groups and the collectives on plain
tensors; ``wire``), and the cross-rank check of ``SCOPEDLITE_DEBUG=1`` (``debug``)."""
