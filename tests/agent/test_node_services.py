"""Backends take the node's services through ``Backend.create_on_node``, whatever their name.

The agent builds every enabled backend the same way; a backend registered under any
name receives the agent's hub and process registry if it asks for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from typing_extensions import Self

from tslice.agent import app, channel
from tslice.agent import config as agent_config
from tslice.agent.backends import app_channel, base, cuda, registry, services
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


class ServiceRecorder(base.Backend):
    """A backend outside the built-in names that wants the node's services."""

    name = "recorder"
    built: ClassVar[list[tuple[dict[str, Any], services.NodeServices]]] = []

    @classmethod
    def create_on_node(
        cls, settings: Mapping[str, Any], node_services: services.NodeServices
    ) -> Self:
        cls.built.append((dict(settings), node_services))
        return cls()

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        return base.OpResult()

    async def restore(self, job: base.JobContext) -> base.OpResult:
        return base.OpResult()


async def test_every_backend_gets_the_node_services_it_asks_for(tmp_path: Path) -> None:
    config = agent_config.AgentConfig(
        node_name="node-s",
        state_dir=tmp_path,
        default_backend="noop",
        backends=("recorder", "app-channel", "cuda"),
        backend_settings={"recorder": {"colour": "blue"}, "cuda": {"driver": "fake"}},
    )
    hub = channel.ChannelHub()
    processes = registration.ProcessRegistry()
    names = {**registry.BUILTIN, "recorder": f"{__name__}:ServiceRecorder"}
    ServiceRecorder.built.clear()
    built = await app.build_backends(config, hub=hub, processes=processes, names=names)
    try:
        ((settings, node_services),) = ServiceRecorder.built
        assert settings == {"colour": "blue"}
        assert (node_services.node, node_services.state_dir) == ("node-s", tmp_path)
        assert node_services.hub is hub and node_services.processes is processes
        channel_backend = built["app-channel"]
        assert isinstance(channel_backend, app_channel.AppChannelBackend)
        assert channel_backend.hub is hub
        cuda_backend = built["cuda"]
        assert isinstance(cuda_backend, cuda.CudaBackend)
        assert cuda_backend.registry is processes
    finally:
        for backend in built.values():
            await backend.close()


def test_without_node_services_a_backend_is_built_from_its_settings() -> None:
    backend = registry.create("noop", settings={"delay_s": 0.0})
    assert backend.name == "noop"
