"""tslice.sim."""
