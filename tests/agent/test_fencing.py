"""Fencing by leader term: a real agent process refuses a deposed orchestrator leader's
directives (nothing moves on its simulated devices), remembers the term across a SIGKILL,
and the orchestrator's agent client reports the refusal as deposed (never adopting a term
or a grant mark from it)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.agent.conftest import AgentRunner
from tests.agent.processes import AgentProcess
from tests.cli.support import run_cli
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator.switch import links, step
from tslice.orchestrator.switch import pool as agents
from tslice.rpc import refusals
from tslice.security import fencing, leader_term
from tslice.server import grant_marks

KEY = "x-tslice-leader-term"
LEADER = "x-tslice-leader-identity"


def test_the_metadata_key_is_pinned() -> None:
    # Part of the wire between orchestrator replicas and agents of different versions.
    assert leader_term.METADATA_KEY == KEY
    assert leader_term.Term().metadata() == ()  # term 0 (embedded mode) sends nothing
    assert leader_term.Term(7).metadata() == ((KEY, "7"),)
    assert leader_term.Term(7, leader="orch-a").metadata() == ((KEY, "7"), (LEADER, "orch-a"))


def test_the_fence_admits_newer_and_refuses_older_directives() -> None:
    fence = fencing.TermFence(None)
    fence.admit(0, directive=True)  # embedded mode on a node that never saw a term
    fence.admit(3, directive=False)  # adopted from a read
    assert fence.seen == 3
    # What a call must send to pass without a look (a GrantStream's grants compare it).
    assert fence.current == fencing.Sent(3, "")
    fence.admit(1, directive=False)  # a read of an old leader is answered
    with pytest.raises(refusals.Refused) as old:
        fence.admit(2, directive=True)
    assert old.value.code is refusals.Code.FAILED_PRECONDITION
    assert "directive from leader term 2, but this agent has seen term 3" in old.value.message
    assert "must step down" in old.value.message
    assert leader_term.seen_in(old.value.message) == 3
    with pytest.raises(refusals.Refused) as unfenced:
        fence.admit(0, directive=True)
    assert "DELETE FROM leader_term" in unfenced.value.message
    fence.accept_unfenced = True
    fence.admit(0, directive=True)
    with pytest.raises(refusals.Refused):
        fence.admit(2, directive=True)  # the knob never lets an old term through
    assert fence.seen == 3 and fence.current == fencing.Sent(3, "")
    with pytest.raises(refusals.Refused) as bad:
        fencing.sent_term([(KEY, "-1")])
    assert bad.value.code is refusals.Code.INVALID_ARGUMENT
    assert fencing.sent_term([("other", "5"), (KEY, b"5")]) == 5


def test_a_term_belongs_to_the_first_leader_that_names_it() -> None:
    fence = fencing.TermFence(None)
    fence.admit(4, directive=False, leader="orch-a")
    assert (fence.seen, fence.leader) == (4, "orch-a")
    fence.admit(4, directive=True, leader="orch-a")
    # Another replica in the same term (the Lease deleted, created again at the same
    # count): refused, as an older term would be, and the refusal deposes it.
    for leader in ("orch-b", ""):
        with pytest.raises(refusals.Refused) as second:
            fence.admit(4, directive=True, leader=leader)
        assert second.value.code is refusals.Code.FAILED_PRECONDITION
        assert "two orchestrator replicas were elected in one term" in second.value.message
        assert leader_term.seen_in(second.value.message) == 4
    fence.admit(4, directive=False, leader="orch-b")  # a read is answered, adopts nothing
    assert fence.leader == "orch-a"
    fence.admit(5, directive=True, leader="orch-b")  # a newer term: its own leader
    assert (fence.seen, fence.leader) == (5, "orch-b")
    # A term recorded without a leader (an earlier release) goes to the first that names it.
    legacy = fencing.TermFence(None, seen=7)
    legacy.admit(7, directive=True, leader="orch-c")
    assert legacy.leader == "orch-c"
    with pytest.raises(refusals.Refused):
        legacy.admit(7, directive=True, leader="orch-d")
    assert fencing.sent([(KEY, "3"), (LEADER, "orch-a")]) == fencing.Sent(3, "orch-a")
    with pytest.raises(refusals.Refused) as too_high:  # more than a Lease can count
        fencing.sent([(KEY, str(2**31))])
    assert too_high.value.code is refusals.Code.INVALID_ARGUMENT
    assert "2147483647" in too_high.value.message
    with pytest.raises(refusals.Refused) as bad:
        fencing.sent([(KEY, "3"), (LEADER, "x\n" * 200)])
    assert bad.value.code is refusals.Code.INVALID_ARGUMENT


def _term(value: int) -> tuple[tuple[str, str], ...]:
    return ((KEY, str(value)),)


async def _grant(
    client: agents.AgentClient, job: str, epoch: int, evict: list[str]
) -> pb.GrantResponse:
    """A Grant through the link the orchestrator moves the node with (its GrantStream)."""
    link = client.link
    if not isinstance(link, links.GrantLink):
        link = step.chosen(client, await client.status())
    assert isinstance(link, links.GrantLink)
    request = pb.GrantRequest(
        job_id=job, group="g", grant_epoch=epoch, evict=evict, restore=True, wait_ms=10_000
    )
    return await link.grant(request, timeout_s=20)


def _journal(state_dir: Path) -> list[tuple[str, str]]:
    return [(e.job, e.event) for e in device.read_journal(state_dir / device.JOURNAL_FILE)]


async def _refused(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def _agent(state_dir: Path, processes: list[AgentProcess]) -> tuple[AgentProcess, str]:
    """A real agent process on ``state_dir``, and its address."""
    agent = AgentProcess(state_dir)
    processes.append(agent)
    await agent.start()
    return agent, agent.address


async def test_a_deposed_leader_moves_nothing_even_after_a_sigkill(
    tmp_path: Path, processes: list[AgentProcess]
) -> None:
    state_dir = tmp_path / "state"
    first, address = await _agent(state_dir, processes)
    old_term, new_term = leader_term.Term(2), leader_term.Term(3)
    deposed: list[int] = []
    old_term.on_deposed(deposed.append)
    old = agents.AgentClient(address, term=old_term)
    new = agents.AgentClient(address, term=new_term)
    try:
        await old.status()
        assert (await _grant(old, "job-a", 1, [])).granted  # over the old leader's stream
        await new.status()  # the new leader's first read fences the node

        with pytest.raises(agents.AgentDeposed) as info:
            await _grant(old, "job-b", 2, ["job-a"])
        assert (info.value.sent, info.value.seen) == (2, 3)
        assert grant_marks.mark_of(info.value.reason) is None  # nothing to number past
        with pytest.raises(agents.AgentDeposed):
            await old.snapshot(job_id="job-a", group="g")
        with pytest.raises(agents.AgentDeposed):
            await old.reset_job(job_id="job-a", group="g")
        assert deposed == [3, 3, 3]
        assert old_term.value == 2  # never adopted from a refusal
        assert _journal(state_dir) == [("job-a", "alloc")]

        await first.kill()
        second = AgentProcess(state_dir)
        processes.append(second)
        stub = await second.start()
        restore = pb.RestoreRequest(job_id="job-a", group="g")
        err = await _refused(stub.Restore(restore, metadata=_term(2)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has seen term 3" in (err.details() or "")
        prefetch = pb.RestoreRequest(job_id="job-a", group="g", prefetch=True)
        err = await _refused(stub.Restore(prefetch, metadata=_term(2)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        wait = pb.WaitOperationRequest(operation_id="00000000-0000-4000-8000-000000000000")
        err = await _refused(stub.WaitOperation(wait, metadata=_term(1)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        # No term at all, from an embedded or llm-d orchestrator: refused, with the fix.
        err = await _refused(stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g")))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "DELETE FROM leader_term" in (err.details() or "")
        err = await _refused(stub.Grant(pb.GrantRequest(job_id="job-b"), metadata=((KEY, "x"),)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Reads are answered whatever the term.
        status = await stub.Status(pb.StatusRequest(), metadata=_term(1))
        assert [(j.job_id, j.state) for j in status.job_statuses] == [
            ("job-a", pb.JOB_STATE_RUNNING)
        ]
        assert _journal(state_dir) == [("job-a", "alloc")]

        # A stream the old leader opens now is refused grant by grant (refused as a whole,
        # it would read as an agent without GrantStream, and the refusal would be lost).
        address = second.address
        await old.close()
        old = agents.AgentClient(address, term=old_term)
        await old.status()
        with pytest.raises(agents.AgentDeposed):
            await _grant(old, "job-b", 2, ["job-a"])

        # The new leader moves the node; re-elected later, it re-opens its stream.
        await new.close()
        new = agents.AgentClient(address, term=new_term)
        await new.status()
        assert (await _grant(new, "job-b", 2, ["job-a"])).granted
        new_term.advance(4)
        await new.drop_link()  # as a new leadership does: its stream re-opens in term 4
        await new.status()  # term 4 adopted: a stream still in term 3 would be refused
        assert (await _grant(new, "job-a", 3, ["job-b"])).granted
        assert _journal(state_dir) == [
            ("job-a", "alloc"),
            ("job-a", "free"),
            ("job-b", "alloc"),
            ("job-b", "free"),
            ("job-a", "alloc"),
        ]
    finally:
        await old.close()
        await new.close()


async def test_with_authentication_only_the_orchestrator_raises_the_term(
    agents: AgentRunner,
) -> None:
    tokens = {"reader": "token-of-a-reader", "orch": "token-of-the-orchestrator"}
    entries = [
        {"name": name, "roles": ["orchestrator"] if name == "orch" else [], "sha256": _sha(token)}
        for name, token in tokens.items()
    ]
    agent = await agents.start(auth={"tokens": entries})

    def as_(name: str, term: int) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {tokens[name]}"), *_term(term))

    # A reader's Status with a huge term would fence the leader out: it is not adopted.
    await agent.stub.Status(pb.StatusRequest(), metadata=as_("reader", leader_term.MAX_TERM))
    await agent.stub.Status(pb.StatusRequest(), metadata=as_("orch", 5))
    await agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g"), metadata=as_("orch", 5))
    err = await _refused(
        agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g"), metadata=as_("orch", 4))
    )
    assert "has seen term 5" in (err.details() or "")


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def test_two_leaders_of_one_term_the_second_is_deposed_even_after_a_sigkill(
    tmp_path: Path, processes: list[AgentProcess]
) -> None:
    state_dir = tmp_path / "state"
    first, address = await _agent(state_dir, processes)
    ours, theirs = leader_term.Term(2, leader="orch-a"), leader_term.Term(2, leader="orch-b")
    deposed: list[int] = []
    theirs.on_deposed(deposed.append)
    a = agents.AgentClient(address, term=ours)
    b = agents.AgentClient(address, term=theirs)
    try:
        await a.status()  # the first of term 2 to reach the node: it is orch-a's term
        assert (await _grant(a, "job-a", 1, [])).granted
        await b.status()  # answered, adopts nothing
        with pytest.raises(agents.AgentDeposed) as info:
            await _grant(b, "job-b", 2, ["job-a"])
        assert (info.value.sent, info.value.seen) == (2, 2)
        assert deposed == [2]
        await first.kill()
        second = AgentProcess(state_dir)
        processes.append(second)
        stub = await second.start()
        grant = pb.GrantRequest(job_id="job-b", group="g", grant_epoch=2, evict=["job-a"])
        err = await _refused(stub.Grant(grant, metadata=theirs.metadata()))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "from orch-a" in (err.details() or "")
        assert _journal(state_dir) == [("job-a", "alloc")]
    finally:
        await a.close()
        await b.close()


async def test_without_authentication_a_term_beyond_a_lease_fences_nobody_out(
    agents: AgentRunner,
) -> None:
    agent = await agents.start()
    err = await _refused(agent.stub.Status(pb.StatusRequest(), metadata=_term(2**63 - 1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The leader of term 5 is not fenced out by it.
    await agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g"), metadata=_term(5))


async def test_an_administrator_resets_the_term_and_nobody_else_may(
    agents: AgentRunner, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = {"admin": "token-of-the-admin", "orch": "token-of-the-orchestrator"}
    roles = {"admin": ["admin"], "orch": ["orchestrator"]}
    entries = [{"name": n, "roles": roles[n], "sha256": _sha(t)} for n, t in tokens.items()]
    agent = await agents.start(auth={"tokens": entries})
    orch = (("authorization", f"Bearer {tokens['orch']}"),)
    leader = leader_term.Term(9, leader="orch-a").metadata()
    await agent.stub.Status(pb.StatusRequest(), metadata=(*orch, *leader))
    reset = pb.ResetLeaderTermRequest()
    err = await _refused(agent.stub.ResetLeaderTerm(reset, metadata=orch))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    err = await _refused(
        agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g"), metadata=orch)
    )
    assert "DELETE FROM leader_term" in (err.details() or "")  # fenced: no term sent
    assert "tslice admin reset-term" in (err.details() or "")
    monkeypatch.setenv("TSLICE_TOKEN", tokens["admin"])
    args = ("admin", "reset-term", "--agent", agent.address)
    code, out, _ = await asyncio.to_thread(run_cli, capsys, *args)
    assert code == 0, out
    assert f"agent {agent.address}: leader term 9 (orch-a) -> 0" in out
    # An orchestrator without a term drives the node again; the next leader fences it.
    await agent.stub.Grant(pb.GrantRequest(job_id="job-a", group="g"), metadata=orch)
    code, _, error = await asyncio.to_thread(run_cli, capsys, *args, "--term", str(2**31))
    assert code == 1 and "INVALID_ARGUMENT" in error and "2147483647" in error
