"""Group locks in a given state, for the tests of the pure per-group lock."""

from __future__ import annotations

from tslice.orchestrator.group import lock as lk


def locked(job: str = "a") -> lk.GroupLock:
    g = lk.GroupLock()
    g.on_acquire(job, now=0)
    g.on_switch_done(epoch=g.grant_epoch, restored=False, now=0)
    return g
