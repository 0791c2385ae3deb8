"""One group of accelerators: its lock (pure), the executor of its decisions, its driver."""
