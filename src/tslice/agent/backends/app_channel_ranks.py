"""The ``app-channel`` backend's moves of a job with several ranks on a node.

A multi-process job (one process per GPU: FSDP ranks, a tensor-parallel engine)
registers one workload channel per process, each with its ``rank``
(``RegisterWorkload.rank``; the hub keeps one session per (job, group, rank)). The
job is resident only when every rank is, so a move is all or nothing:

- A snapshot asks every rank at once (one command each, all sent before any answer
  is awaited). If a rank fails, every rank that moved (or may have moved: no answer
  in time; a failed rank too, as it may have moved part of its state) is told to
  restore, all at once; the job is then unchanged (RUNNING) and
  the error names the rank that failed (:class:`RanksRolledBackError`). If that
  restore fails too, the error is fatal and says which ranks are where.
- A restore asks every rank at once; on failure the error says which ranks are
  resident and which are not.
- A rank that left (its stream ended, or its lost channel's grace ran out) took its
  state with it, as a job's only workload does: a snapshot has nothing to move for it,
  and a restore is refused until it registers again. A rank whose channel is lost is
  waited for at most the rest of its grace.

A job whose only workload is rank 0 (every workload that sends no rank) is not moved
here: :mod:`tslice.agent.backends.app_channel` keeps its single-workload rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from tslice.agent import channel
from tslice.agent.backends import base
from tslice.common import residency

log = logging.getLogger(__name__)

Kind = Literal["snapshot", "restore"]
#: Sends one command to one rank (the backend binds the job, the tags and the mode).
Send = Callable[[Kind, int], Awaitable[channel.CommandOutcome]]


class RanksRolledBackError(base.RefusedBackendError):
    """A rank failed its snapshot; the ranks that had moved were brought back: the job is
    unchanged (RUNNING)."""


class RankLeftError(base.RefusedBackendError):
    """A rank of the job left the node, its state with it: nothing to restore until it
    registers again. Nothing was sent."""


@dataclasses.dataclass(frozen=True)
class _Answer:
    rank: int
    outcome: channel.CommandOutcome | None = None
    error: str = ""
    #: The rank may have moved some of its state (no answer in time, or disconnected).
    uncertain: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome is not None and self.outcome.ok


def is_ranked(hub: channel.ChannelHub, job_id: str, group: str) -> bool:
    """Whether (job, group) has, or had, a workload with a rank other than 0."""
    return any(
        rank
        for known in (
            hub.rank_states(job_id, group),
            hub.departed_ranks(job_id, group),
            hub.lost_ranks(job_id, group),
        )
        for rank in known
    )


async def move(
    hub: channel.ChannelHub,
    job: base.JobContext,
    kind: Kind,
    send: Send,
    already: Callable[[channel.WorkloadState], bool],
) -> base.OpResult:
    """Move every rank of the job at once, all or nothing (the module docstring's rules).

    ``already(state)``: the rank reports that it has nothing left to do.
    """
    lost = hub.lost_ranks(job.job_id, job.group)
    if lost:
        with contextlib.suppress(TimeoutError):
            await hub.wait_ranks_settled(job.job_id, job.group, timeout=max(lost.values()))
    live = hub.rank_states(job.job_id, job.group)
    left = hub.departed_ranks(job.job_id, job.group)
    who = channel.describe(job.job_id, job.group)
    if kind == "restore" and left:
        reasons = "; ".join(f"rank {r}: {d.reason}" for r, d in sorted(left.items()))
        raise RankLeftError(
            f"{_ranks(left)} of {who} left this node, taking their device state with "
            f"them ({reasons}): the job cannot be resident until every rank registers again"
        )
    still = hub.lost_ranks(job.job_id, job.group)
    if still:
        raise base.FatalBackendError(
            f"{_ranks(still)} of {who} lost their workload channel and neither came back "
            "nor counted as gone; nothing was sent"
        )
    to_move = sorted(r for r, state in live.items() if not already(state))
    answers = list(await asyncio.gather(*(_ask(send, kind, r) for r in to_move)))
    failed = [a for a in answers if not a.ok]
    if not failed:
        return _result(hub, job, kind, answers, left)
    what = "; ".join(f"rank {a.rank}: {a.error}" for a in failed)
    message = f"{kind} of {who} failed on {_ranks(failed)} of {len(to_move)} moved ({what})"
    # Every rank that was sent the snapshot is told to restore, the failed ones too: a
    # rank that failed half-way may have moved part of its state (a restore of what is
    # resident moves nothing).
    moved = [a.rank for a in answers if a.outcome is not None or a.uncertain]
    if kind == "restore":
        raise base.FatalBackendError(f"{message}; {_where(hub, job, to_move)}")
    back = list(await asyncio.gather(*(_ask(send, "restore", r) for r in moved)))
    broken = [a for a in back if not a.ok]
    if broken:
        not_back = "; ".join(f"rank {a.rank}: {a.error}" for a in broken)
        raise base.FatalBackendError(
            f"{message}; then {_ranks(broken)} could not be brought back ({not_back}); "
            f"{_where(hub, job, sorted(live))}. Check the workload, then reset the job"
        )
    if moved:
        message += f"; {_ranks(moved)}, sent the snapshot, were brought back"
    message += "; the job is unchanged"
    log.warning("%s", message, extra={"job_id": job.job_id, "group_id": job.group})
    raise RanksRolledBackError(message)


async def _ask(send: Send, kind: Kind, rank: int) -> _Answer:
    try:
        outcome = await send(kind, rank)
    except (channel.CommandRefusedError, channel.NoWorkloadError) as exc:
        return _Answer(rank, error=str(exc))  # nothing was sent
    except channel.ChannelError as exc:
        return _Answer(rank, error=str(exc), uncertain=True)
    if not outcome.ok:
        error = f"command {outcome.command_id}: {outcome.error or 'no error message given'}"
        return _Answer(rank, outcome, error=error)
    return _Answer(rank, outcome)


def _result(
    hub: channel.ChannelHub,
    job: base.JobContext,
    kind: Kind,
    answers: list[_Answer],
    left: Mapping[int, channel.Departure],
) -> base.OpResult:
    outcomes = [a.outcome for a in answers if a.outcome is not None]
    state = ranks_state(hub.rank_states(job.job_id, job.group), left)
    log.info(
        "%s of %d rank(s) done",
        kind,
        len(answers),
        extra={"job_id": job.job_id, "group_id": job.group, "residency": state["residency"]},
    )
    return base.OpResult(
        device_bytes=sum(max(o.device_bytes, 0) for o in outcomes),
        host_bytes=sum(max(o.host_bytes, 0) for o in outcomes),
        state=state,
        still_resident=kind == "snapshot" and state["residency"] == residency.PARTIAL,
    )


def ranks_state(
    live: Mapping[int, channel.WorkloadState], left: Mapping[int, channel.Departure]
) -> dict[str, Any]:
    """The job's residency record over its ranks: ``full`` only if every rank is, ``none``
    only if no rank holds anything (a rank that left holds nothing); the tags resident
    on every rank; and each rank's own residency under ``ranks``."""
    each = {rank: s.residency for rank, s in live.items()}
    each.update({rank: residency.NONE for rank in left if rank not in live})
    found = set(each.values())
    overall = (
        residency.FULL
        if found == {residency.FULL}
        else residency.NONE
        if found <= {residency.NONE}
        else residency.PARTIAL
    )
    states = list(live.values())
    resident = (
        []
        if left or not states
        else [t for t in states[0].resident_tags if all(t in s.resident_tags for s in states)]
    )
    missing = sorted({t for s in states for t in s.missing_tags})
    return {
        "residency": overall,
        "resident_tags": resident,
        "missing_tags": missing,
        "suspended": all(s.suspended for s in states) and bool(states),
        "ranks": {str(rank): each[rank] for rank in sorted(each)},
    }


def _where(hub: channel.ChannelHub, job: base.JobContext, ranks: list[int]) -> str:
    """Where each rank is now, by what its session reports."""
    live = hub.rank_states(job.job_id, job.group)
    by_place: dict[str, list[int]] = {}
    for rank in ranks:
        state = live.get(rank)
        place = "disconnected" if state is None else f"residency {state.residency}"
        by_place.setdefault(place, []).append(rank)
    return "now: " + "; ".join(f"{_ranks(r)} {p}" for p, r in sorted(by_place.items()))


def _ranks(ranks: Any) -> str:
    numbers = sorted(r.rank if isinstance(r, _Answer) else int(r) for r in ranks)
    word = "rank" if len(numbers) == 1 else "ranks"
    return f"{word} {', '.join(map(str, numbers))}"
