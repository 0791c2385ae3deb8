"""The workload channel: the agent's stream to each in-process workload, and the register
socket that binds a workload to its process.

- ``hub``: :class:`ChannelHub`, one live session per registered (job, group), and the
  commands (snapshot, restore) sent down it; its module docstring has the channel's rules.
- ``stream``: one ``WorkloadChannel`` call, from its registration to its end.
- ``sessions``: one registered workload (its commands in flight, what it holds).
- ``rules``: what a registration and a command must be (pure), and the channel's errors.
- ``departures``: workloads that left, or whose channel was lost within its grace.
- ``presence``: the agent's job records follow who registered and who left.
- ``registration`` and ``quiesce``: the register socket (a process announces itself, the
  kernel names its pid) and the hooks of the processes that announced them.

Who may register is ``tslice.security.admission``'s rule. The hub's interface is
re-exported here: ``channel.ChannelHub``, ``channel.CommandRefusedError``...
"""

from tslice.agent.channel.hub import (
    WORKLOAD_LEFT,
    ChannelError,
    ChannelEvent,
    ChannelHub,
    CommandOutcome,
    CommandRefusedError,
    CommandTimeoutError,
    Departure,
    Listener,
    NoWorkloadError,
    WorkloadDisconnectedError,
    WorkloadState,
    check_grace,
    check_mode,
    check_tags,
    describe,
    resolve_mode,
)

__all__ = [
    "WORKLOAD_LEFT",
    "ChannelError",
    "ChannelEvent",
    "ChannelHub",
    "CommandOutcome",
    "CommandRefusedError",
    "CommandTimeoutError",
    "Departure",
    "Listener",
    "NoWorkloadError",
    "WorkloadDisconnectedError",
    "WorkloadState",
    "check_grace",
    "check_mode",
    "check_tags",
    "describe",
    "resolve_mode",
]
