"""tslice.cli."""
