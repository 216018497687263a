"""Communication plumbing below the strategies: process groups and their store, the wire
format of our collectives, and the cross-rank check of ``SCOPEDLITE_DEBUG=1``."""
