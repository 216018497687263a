"""Hardware probing: devices, cores, XLA; nothing is started or initialised."""
