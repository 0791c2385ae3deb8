"""How many examples each fuzz test runs, and how deterministic it is.

By default every test runs a few dozen examples in a fixed order (``derandomize``, no
example database), so a CI run is fast and repeatable. ``TSLICE_FUZZ_EXAMPLES=N``
runs N examples per test instead, drawn at random (hypothesis prints
the seed and the smallest failing example), for long runs by hand or nightly; pass
``--timeout=0`` too (the suite's per-test limit is 120 s).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES_ENV = "TSLICE_FUZZ_EXAMPLES"


def fuzz_settings(examples: int) -> settings:
    """``examples`` examples per test (``$TSLICE_FUZZ_EXAMPLES`` overrides it)."""
    override = os.environ.get(EXAMPLES_ENV, "")
    long_run = override.isdigit() and int(override) > 0
    return settings(
        max_examples=int(override) if long_run else examples,
        # Calls to real servers: their time is the deadline's business, not hypothesis's.
        deadline=None,
        derandomize=not long_run,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.function_scoped_fixture,
        ],
        print_blob=long_run,
    )
