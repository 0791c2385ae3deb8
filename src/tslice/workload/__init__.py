"""tslice.workload."""
