"""List-then-watch of one kind of object on the API server (lightkube), for every server
that follows the cluster (the orchestrator's topology, the agent's pods on its node).

A stream is a list followed by a watch from the list's resourceVersion. Every event's
object carries the version the stream has reached, and so do BOOKMARK events (asked for
with ``allowWatchBookmarks``: they move the version on while nothing selected changes,
so a resume seldom finds it compacted). A watch the server ends is resumed from the
version reached (lightkube does that); a dropped connection or any other error is
retried from it after a jittered, growing pause; ``410 Gone`` (the version was
compacted) starts the stream again with a fresh list, which the caller takes as the
whole truth of that kind, so deletions missed meanwhile are seen.

lightkube's public ``watch()`` does not ask for bookmarks, so the requests are built with
its request preparation (``GenericAsyncClient``); that is the only non-public use.
lightkube (the ``kubernetes`` extra) is imported only when a function here is called:
the job side imports ``tslice.common`` and must not need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

ALL_NAMESPACES = "*"
#: The server ends each watch after this long (lightkube resumes it at once), seconds.
WATCH_TIMEOUT_S = 300
#: Objects per page of a list.
LIST_PAGE = 500
_HTTP_GONE = 410
#: Watch events handled between two turns of the event loop (a burst is read buffered).
_EVENTS_PER_TURN = 32


class Backoff(Protocol):
    def delay(self, attempt: int) -> float: ...


@dataclasses.dataclass(frozen=True)
class JitteredBackoff:
    """``initial_s * 2**attempt`` up to ``max_s``, times a random 0.5-1 (no lockstep)."""

    initial_s: float = 0.2
    max_s: float = 10.0

    def delay(self, attempt: int) -> float:
        return float(min(self.max_s, self.initial_s * (2**attempt)) * random.uniform(0.5, 1.0))


def connect(kubeconfig: Path | None) -> Any:
    """A lightkube ``AsyncClient``: ``kubeconfig`` if given, else in-cluster, then
    $KUBECONFIG / ~/.kube/config."""
    from lightkube import AsyncClient, KubeConfig
    from lightkube.config import kubeconfig as default

    if kubeconfig is not None:
        cfg = KubeConfig.from_file(kubeconfig)
    else:
        cfg = KubeConfig.from_env(default_config=default.DEFAULT_KUBECONFIG)
    return AsyncClient(config=cfg)


@dataclasses.dataclass
class Stream:
    """What one stream selects, and what it tells its owner."""

    #: A lightkube resource class (``lightkube.resources.core_v1.Pod``...).
    resource: type[Any]
    #: Every object of the first list and of each re-list (the whole truth of the kind).
    on_list: Callable[[list[Any]], None]
    #: ``(type, object)`` of each ADDED, MODIFIED or DELETED event.
    on_event: Callable[[str, Any], None]
    namespace: str | None = None
    labels: str | None = None
    fields: str | None = None
    #: The version reached, each time it moves (bookmarks included).
    on_progress: Callable[[str], None] | None = None
    #: Whose RBAC a refusal points at, in the warning ("the orchestrator's ServiceAccount").
    who: str = "this server's ServiceAccount"
    #: Set after the first full list.
    synced: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: Times the stream started again from a list after its version was gone (for tests).
    relists: int = 0

    def describe(self) -> str:
        where = "all namespaces" if self.namespace == ALL_NAMESPACES else self.namespace
        selected = ", ".join(s for s in (self.labels, self.fields) if s)
        what = f"{self.resource.__name__.lower()}s" + (f" ({selected})" if selected else "")
        return what + (f" in {where}" if where else "")


async def run(
    client: Any,
    stream: Stream,
    *,
    backoff: Backoff | None = None,
    watch_timeout_s: int = WATCH_TIMEOUT_S,
) -> None:
    """Follow ``stream`` until cancelled; never returns otherwise."""
    from lightkube import ApiError

    backoff = backoff or JitteredBackoff()
    version: str | None = None
    failures = 0
    handled = 0
    while True:
        try:
            if version is None:
                version = await _list(client, stream)
                failures = 0
            # Closed on the way out, whatever ends the loop: the response goes with it.
            async with contextlib.aclosing(
                _watch(client, stream, version, watch_timeout_s)
            ) as events:
                async for kind, obj in events:
                    failures = 0
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        stream.on_event(kind, obj)
                    version = (obj.metadata and obj.metadata.resourceVersion) or version
                    if stream.on_progress is not None:
                        stream.on_progress(version)
                    handled += 1
                    if handled % _EVENTS_PER_TURN == 0:
                        # A burst arrives buffered: read on without a pause, it would
                        # hold the event loop (Lease renewals, calls) for its whole length.
                        await asyncio.sleep(0)
        except ApiError as err:
            if err.status.code == _HTTP_GONE:
                log.info(
                    "watch of %s: version %s is gone; listing again", stream.describe(), version
                )
                version = None
                stream.relists += 1
                continue
            failures += 1
            await _pause(stream, backoff, failures, f"{err.status.code} {err.status.message}")
        except Exception as err:  # refused, dropped, undecodable: all retried alike
            failures += 1
            await _pause(stream, backoff, failures, f"{type(err).__name__}: {err}")


async def _pause(stream: Stream, backoff: Backoff, failures: int, why: str) -> None:
    delay = backoff.delay(min(failures - 1, 16))
    log.warning(
        "watch of %s failed (%s); retrying in %.1f s (check the API server address, "
        "the credentials and the RBAC of %s)",
        stream.describe(),
        why,
        delay,
        stream.who,
    )
    await asyncio.sleep(delay)


def _params(stream: Stream) -> dict[str, Any]:
    return {"labelSelector": stream.labels, "fieldSelector": stream.fields}


async def _list(client: Any, stream: Stream) -> str:
    generic = client._client
    br = generic.prepare_request(
        "list",
        res=stream.resource,
        namespace=stream.namespace,
        # Pages of a consistent snapshot (lightkube follows the continue tokens).
        params={**_params(stream), "limit": LIST_PAGE},
    )
    listing = generic.list(br)
    objs = [obj async for obj in listing]
    stream.on_list(objs)
    if not stream.synced.is_set():
        log.info("listed %d %s", len(objs), stream.describe())
        stream.synced.set()
    return str(listing.resourceVersion)


def _watch(
    client: Any, stream: Stream, version: str, timeout_s: int
) -> AsyncGenerator[tuple[str, Any], None]:
    generic = client._client
    br = generic.prepare_request(
        "list",
        res=stream.resource,
        namespace=stream.namespace,
        watch=True,
        params={
            **_params(stream),
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_s,
        },
    )
    events: AsyncGenerator[tuple[str, Any], None] = generic.watch(br)
    return events
