"""Fuzzing every RPC of a real agent (SnapshotAgentService and health) with random and
hostile messages: every call ends with OK or a status a client can act on, its message
is short, and the agent answers health within a second after each example."""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz import calls, methods
from tests.fuzz.conftest import Served
from tests.fuzz.examples import fuzz_settings
from tests.fuzz.methods import AGENT_METHODS


@pytest.mark.parametrize("method", AGENT_METHODS, ids=str)
@given(data=st.data())
@fuzz_settings(25)
def test_every_agent_rpc_answers_fuzzed_messages(
    agent: Served, method: methods.Method, data: st.DataObject
) -> None:
    requests = data.draw(methods.requests_for(method), label="requests")
    answer = methods.call(agent.channel, method, requests)
    event(answer.code.name)  # --hypothesis-show-statistics: how deep the examples got
    answer.check(methods.allowed(method))
    calls.assert_healthy(agent.channel)
