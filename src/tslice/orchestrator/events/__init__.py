"""The orchestrator's events: the bus behind WatchEvents, and the tap."""
