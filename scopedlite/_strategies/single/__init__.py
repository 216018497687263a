"""One process, one device: the strategy of a plain script and of every run outside launch."""
