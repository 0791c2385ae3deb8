"""Identities are literal (issue 21 §2): a certificate that names ``job:*`` or ``job:?``,
signed by the trusted CA (an outside PKI does not refuse such names as ``tslice certs``
does), acts as no job; a grant's job ids are ids, its prefixes explicit; two
``authorization`` headers are refused, not resolved by whichever came last. On the real
servers of ``secure_stack`` (mutual TLS, ``auth:`` on) and on the verifier itself."""

from __future__ import annotations

import pathlib

import grpc
import pytest

from tests.security.conftest import JOB_A_TOKEN, READER_TOKEN, SecureStack
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.security import certs as pki
from tslice.security import identities, tls

TIMEOUT_S = 20.0


def _wildcard_certificate(
    stack: SecureStack, directory: pathlib.Path, identity: str
) -> tls.ClientSecurity:
    """A client certificate for ``identity`` signed by the servers' CA, made as an outside
    PKI would (no check of the name)."""
    x509 = pki._lib().x509
    pair = pki.Pair(directory / "wild.pem", directory / "wild.key")
    san = x509.UniformResourceIdentifier(identities.IDENTITY_SCHEME + identity)
    pki._issue(stack.certs.ca, pair, common_name=identity, sans=[san], client=True, days=1)
    env = stack.certs.env(None)
    env.update(TSLICE_TLS_CERT=str(pair.cert), TSLICE_TLS_KEY=str(pair.key))
    return tls.ClientSecurity.from_env(env)


@pytest.mark.parametrize("identity", ["job:*", "job:?", "job:job-[ab]"])
def test_a_wildcard_job_certificate_acts_as_no_job(
    secure_stack: SecureStack, tmp_path: pathlib.Path, identity: str
) -> None:
    security = _wildcard_certificate(secure_stack, tmp_path, identity)
    with security.channel(secure_stack.orchestrator) as channel:
        orch = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            orch.Acquire(opb.AcquireRequest(job_id="job-a", group_id="wild"), timeout=TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
        assert repr(identity) in err.value.details() and "literally" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            orch.Yield(opb.YieldRequest(job_id="job-b", group_id="wild"), timeout=TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with security.channel(secure_stack.agent) as channel:
        hello = pb.WorkloadMessage(register=pb.RegisterWorkload(job_id="job-a", group="g"))
        stream = pb_grpc.SnapshotAgentServiceStub(channel).WorkloadChannel(
            iter([hello]), timeout=TIMEOUT_S
        )
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stream))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert repr(identity) in err.value.details()


def test_two_authorization_headers_are_refused(secure_stack: SecureStack) -> None:
    """Today the last header would win: a reader's token after a job's would read, a job's
    after a reader's would act as the job. Neither: the call is refused."""
    security = secure_stack.security("job:job-b")  # (mutual TLS: a certificate too)
    with security.channel(secure_stack.orchestrator) as channel:
        orch = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        both = [
            ("authorization", f"Bearer {READER_TOKEN}"),
            ("authorization", f"Bearer {JOB_A_TOKEN}"),
        ]
        with pytest.raises(grpc.RpcError) as err:
            orch.Acquire(
                opb.AcquireRequest(job_id="job-a", group_id="two-headers"),
                timeout=TIMEOUT_S,
                metadata=both,
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "2 'authorization' headers" in err.value.details()
        # One header of the two is enough to be let in (the check is not a lock-out).
        orch.ListGroups(opb.ListGroupsRequest(), timeout=TIMEOUT_S, metadata=both[:1])


def test_grant_job_ids_are_literal_and_prefixes_explicit() -> None:
    with pytest.raises(ValueError, match=r"x\.jobs\[0\].*job_prefixes: \['ci/'\]"):
        identities.Grant.parse(
            {"name": "ci", "roles": ["job"], "jobs": ["ci/*"]}, where="x", token=False
        )
    with pytest.raises(ValueError, match=r"x\.jobs\[0\]"):
        identities.Grant.parse(
            {"name": "ci", "roles": ["job"], "jobs": ["*"]}, where="x", token=False
        )
    with pytest.raises(ValueError, match=r"x\.job_prefixes\[0\]"):
        identities.Grant.parse(
            {"name": "ci", "roles": ["job"], "job_prefixes": [""]}, where="x", token=False
        )
    grant = identities.Grant.parse(
        {"name": "ci", "roles": ["job"], "jobs": ["nightly"], "job_prefixes": ["ci/"]},
        where="x",
        token=False,
    )
    ci = grant.principal("certificate")
    assert ci.may_act_as("ci/run-1") and ci.may_act_as("nightly")
    assert not ci.may_act_as("prod/run-1") and not ci.may_act_as("nightly-2")


def test_a_custom_verifiers_job_ids_are_literal_too() -> None:
    principal = identities.Principal(
        "pod:x", frozenset({identities.JOB}), ("*", "job-?"), "kubernetes"
    )
    assert not principal.may_act_as("job-a") and not principal.may_act_as("anything")
    assert principal.may_act_as("*")  # (only the literal string, which no job id can be)


@pytest.mark.parametrize("identity", ["job:*", "job:?", "job:", "job:a b"])
def test_the_certificate_convention_refuses_a_job_identity_that_is_not_a_job_id(
    identity: str,
) -> None:
    with pytest.raises(identities.Unauthenticated, match="compared literally"):
        identities.StaticVerifier().verify(identities.Presented(identities=(identity,)))
