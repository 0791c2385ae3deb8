"""A Yield re-issued after UNAVAILABLE that meets a refusal of the caller's identity is
an error: only a job that no longer holds the group let go (issue 17 §6).

Real servers with mutual TLS and authentication on (``secure_stack``). The impostor's
client is given a closed port first and the orchestrator second, without a first-contact
probe: its Yield's first attempt finds nothing listening (UNAVAILABLE, as when the
orchestrator restarts), the re-issued one reaches the orchestrator and is refused
PERMISSION_DENIED because job-a's certificate may not act as job-b. The same code
answers a re-issued Yield whose first attempt did hand the group on; the client must
tell the two apart, not report the refusal as a successful yield.
"""

from __future__ import annotations

import grpc
import pytest

import tslice
from tests.harness.ports import closed_port
from tests.security.conftest import SecureStack
from tslice.common import errors


def test_a_reissued_yield_refused_by_identity_is_an_error(secure_stack: SecureStack) -> None:
    group = "reissued-yield"
    holder = tslice.Client(
        secure_stack.orchestrator,
        job_id="job-b",
        security=secure_stack.security("job:job-b"),
        lease_s=None,
    )
    impostor = tslice.Client(
        [f"127.0.0.1:{closed_port()}", secure_stack.orchestrator],
        job_id="job-b",
        security=secure_stack.security("job:job-a"),
        lease_s=None,
        connect_timeout=None,  # no first-contact probe: the Yield's first attempt fails
    )
    with holder, impostor:
        assert holder.acquire(group).success
        with pytest.raises(errors.RPCError) as caught:
            impostor.yield_(group)
        assert caught.value.status == grpc.StatusCode.PERMISSION_DENIED
        assert "may not act as job 'job-b'" in caught.value.message
        assert holder.status(group).locking_job == "job-b"  # nothing was let go
        assert holder.yield_(group).success


async def test_the_async_client_tells_them_apart_too(secure_stack: SecureStack) -> None:
    group = "reissued-yield-async"
    async with (
        tslice.AsyncClient(
            secure_stack.orchestrator,
            job_id="job-b",
            security=secure_stack.security("job:job-b"),
            lease_s=None,
        ) as holder,
        tslice.AsyncClient(
            [f"127.0.0.1:{closed_port()}", secure_stack.orchestrator],
            job_id="job-b",
            security=secure_stack.security("job:job-a"),
            lease_s=None,
            connect_timeout=None,
        ) as impostor,
    ):
        assert (await holder.acquire(group)).success
        with pytest.raises(errors.RPCError) as caught:
            await impostor.yield_(group)
        assert caught.value.status == grpc.StatusCode.PERMISSION_DENIED
        assert (await holder.status(group)).locking_job == "job-b"
        assert (await holder.yield_(group)).success
