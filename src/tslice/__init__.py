"""tslice: co-operative time-slicing of accelerators between independent jobs.

::

    import tslice

    client = tslice.Client()          # $TSLICE_ORCHESTRATOR, $TSLICE_JOB_ID; no-op if unset
    with client.slice("trainer"):
        train_step()
"""

from __future__ import annotations

import importlib
from typing import Any

from tslice.client import (
    AcquireResult,
    AgentJobState,
    AgentJobStatus,
    AsyncClient,
    Client,
    GroupState,
    GroupStatus,
    OrchestratorEvent,
    RetryPolicy,
    SnapshotAgentClient,
    SnapshotAgentError,
    TimeSliceOrchestratorClient,
    YieldResult,
)
from tslice.common import version
from tslice.common.errors import (
    AcquireTimeout,
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    NotHolder,
    RPCError,
    TsliceError,
    Unavailable,
    UnknownGroup,
)

__version__ = version.VERSION

__all__ = [
    "AcquireResult",
    "AcquireTimeout",
    "AgentJobState",
    "AgentJobStatus",
    "AsyncClient",
    "Cancelled",
    "Client",
    "ConfigError",
    "DeadlineExceeded",
    "GroupState",
    "GroupStatus",
    "InvalidArgument",
    "NotFound",
    "NotHolder",
    "OrchestratorEvent",
    "RPCError",
    "RetryPolicy",
    "SnapshotAgentClient",
    "SnapshotAgentError",
    "TimeSliceOrchestratorClient",
    "TsliceError",
    "Unavailable",
    "UnknownGroup",
    "YieldResult",
    "__version__",
]

# Re-exported from tslice.workload on first access, and only if it provides them,
# so that `import tslice` stays light and works without the workload layer.
_FROM_WORKLOAD = ("register_workload", "WorkloadHandle")


def __getattr__(name: str) -> Any:
    if name in _FROM_WORKLOAD:
        workload = importlib.import_module("tslice.workload")
        try:
            return getattr(workload, name)
        except AttributeError:
            raise AttributeError(
                f"tslice.{name} is not available: tslice.workload does not provide it"
            ) from None
    raise AttributeError(f"module 'tslice' has no attribute {name!r}")
