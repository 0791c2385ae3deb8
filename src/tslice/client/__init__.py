"""tslice.client."""
