"""tslice: co-operative time-slicing of accelerators between independent jobs."""

__version__ = "0.1.0"
