"""tslice.orchestrator."""
