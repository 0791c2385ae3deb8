"""Node layer: the snapshot agent and its backends."""
