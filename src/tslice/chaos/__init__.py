"""Runs that put the servers under fire and check what the jobs saw: random kills of
real processes (``runner``, its job processes ``job_process``) and the grant promise
under evictions, cancels and orchestrator kills (``promises``). Used by the short forms
in the test suite and the long ones in ``bench/soak.py``."""
