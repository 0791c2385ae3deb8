"""What survives a restart: the lock store, its records, the event history, its health."""
