"""Backends move one job's device state on one node; see ``base.Backend``."""
