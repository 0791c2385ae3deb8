"""The tslice client library: acquire and yield groups of accelerators.

``Client`` (blocking) and ``AsyncClient`` (asyncio) are the native API;
:mod:`tslice.client.compat` holds drop-in replacements for llm-d's clients.
"""

from tslice.client import compat
from tslice.client._admin import DrainState, EvictedRole, Eviction
from tslice.client._async_client import AsyncClient
from tslice.client._channel import DEFAULT_CHANNEL_OPTIONS
from tslice.client._client import Client
from tslice.client._config import USE_CLIENT_DEFAULT, ClientConfig
from tslice.client._retry import DEFAULT_RETRY, NO_RETRY, RetryPolicy
from tslice.client._slice import AsyncSliceContext, SliceContext
from tslice.client._types import (
    AcquireResult,
    AgentJobState,
    AgentJobStatus,
    DegradedNode,
    EventKind,
    GroupState,
    GroupStatus,
    OrchestratorEvent,
    StoredEvents,
    YieldResult,
)
from tslice.client.compat import (
    SnapshotAgentClient,
    SnapshotAgentError,
    TimeSliceOrchestratorClient,
)

__all__ = [
    "DEFAULT_CHANNEL_OPTIONS",
    "DEFAULT_RETRY",
    "NO_RETRY",
    "USE_CLIENT_DEFAULT",
    "AcquireResult",
    "AgentJobState",
    "AgentJobStatus",
    "AsyncClient",
    "AsyncSliceContext",
    "Client",
    "ClientConfig",
    "DegradedNode",
    "DrainState",
    "EventKind",
    "EvictedRole",
    "Eviction",
    "GroupState",
    "GroupStatus",
    "OrchestratorEvent",
    "RetryPolicy",
    "SliceContext",
    "SnapshotAgentClient",
    "SnapshotAgentError",
    "StoredEvents",
    "TimeSliceOrchestratorClient",
    "YieldResult",
    "compat",
]
