"""Random bytes as the serialized requests of every RPC of both servers (and of their
health service): what parses is answered as any request would be; what does not is
refused with INVALID_ARGUMENT, short, and the server answers health within a second
after each example. (gRPC alone ends such a unary call UNKNOWN, with a traceback in
the server's log, and a stream OK as if every request had been answered.)"""

from __future__ import annotations

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from tests.fuzz import calls, methods, strategies
from tests.fuzz.conftest import Served
from tests.fuzz.examples import fuzz_settings
from tests.fuzz.methods import AGENT_METHODS, ORCHESTRATOR_METHODS

CASES = [
    *(pytest.param("agent", m, id=f"agent-{m}") for m in AGENT_METHODS),
    *(pytest.param("orchestrator", m, id=f"orchestrator-{m}") for m in ORCHESTRATOR_METHODS),
]


@pytest.mark.parametrize(("server", "method"), CASES)
@given(payloads=st.lists(strategies.random_bytes(), min_size=1, max_size=3))
@example(payloads=[b"\xff"])
@fuzz_settings(15)
def test_every_rpc_refuses_random_bytes(
    request: pytest.FixtureRequest, server: str, method: methods.Method, payloads: list[bytes]
) -> None:
    served: Served = request.getfixturevalue(server)
    try:
        event(methods.check_raw(served.channel, method, payloads).code.name)
    finally:
        methods.leave_as_found(served.channel, methods.read_requests(method, payloads) or [])
    calls.assert_healthy(served.channel)
