"""Every status message a server sends is at most 2,048 characters (security.md), the
note of what was cut included: ``validation.bounded`` for any text and limit, and a real
orchestrator's NOT_FOUND that names a dozen long ``--group`` ids."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import calls
from tests.fuzz.conftest import Served, orchestrator_process, served
from tests.fuzz.examples import fuzz_settings
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import validation


@given(
    text=st.one_of(st.text(max_size=300), st.integers(0, 3_000_000).map(lambda n: "x" * n)),
    limit=st.integers(1, 4096),
)
@fuzz_settings(100)
def test_bounded_text_fits_its_limit_and_keeps_its_start(text: str, limit: int) -> None:
    cut = validation.bounded(text, limit)
    assert len(cut) <= limit
    if len(text) <= limit:
        assert cut == text
    else:
        kept = cut.split("…", 1)[0]
        assert text.startswith(kept)


def test_bounded_names_how_much_was_cut() -> None:
    cut = validation.bounded("y" * 3_000_000)
    assert len(cut) == validation.MAX_MESSAGE
    assert cut.endswith(f"… ({3_000_000 - cut.index('…')} more characters cut)")


@pytest.fixture
def many_groups(agent: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    groups = [f"group-{i:02d}-" + "g" * 240 for i in range(12)]
    state = tmp_path_factory.mktemp("many-groups")
    server = orchestrator_process(state, agent.server.address, groups=groups)
    yield from served(server)


def test_a_not_found_naming_long_groups_is_cut_to_2048_characters(many_groups: Served) -> None:
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(many_groups.channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="nope"), timeout=calls.PROMPT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    details = info.value.details() or ""
    assert "more characters cut" in details
    assert len(details) <= validation.MAX_MESSAGE, len(details)
