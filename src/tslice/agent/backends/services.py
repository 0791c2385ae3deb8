"""What the agent gives the backends it builds, besides their section of the config.

Some backends need a piece of the running agent: app-channel sends commands through
the workload channel hub, cuda finds a job's processes in the registry they announced
themselves to. Rather than the agent knowing which backend wants what (a branch per
backend name), every backend is built with :meth:`Backend.create_on_node
<tslice.agent.backends.base.Backend.create_on_node>` and takes from
:class:`NodeServices` what it uses.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tslice.agent import channel
from tslice.agent.channel import registration


@dataclasses.dataclass(frozen=True)
class NodeServices:
    """The running agent's node-wide services (built once in ``tslice.agent.app``)."""

    #: This node's name, as reported in Status.
    node: str
    #: The agent's state directory; a backend may keep its files below it.
    state_dir: Path
    #: The workload channel hub that registered workloads are reached through.
    hub: channel.ChannelHub
    #: Processes that announced themselves for a job over the registration socket.
    processes: registration.ProcessRegistry
