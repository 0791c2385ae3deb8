"""HA mode's state: every group's lock record in a ConfigMap of the API server (lightkube).

One ConfigMap per group (:func:`configmap_name`), labelled :data:`STATE_LABEL`, in the
Lease's namespace: ``data.group`` (the group id), ``data.nodes`` (JSON ``[[name,
address], ...]``), ``data.record`` (the lock record, ``kube.codec``), and the annotation
:data:`TERM_ANNOTATION`, the leader term of its last writer.

Writes use optimistic concurrency. A new leader first *claims* every ConfigMap (an
update carrying the version it read, setting its term), so the version each older
leader last wrote is stale; every later write carries the version this leader last
wrote. A write refused with 409 Conflict was someone else's in between: the ConfigMap
is read again, and if a newer term wrote it this leader is deposed
(:class:`tslice.orchestrator.persistence.store.Deposed`, and ``on_deposed``: it stops leading at
once); a write of its own whose answer was lost (the same term, and this replica's
identity in :data:`LEADER_ANNOTATION`) is adopted and retried. A write of the same term
by another identity is never adopted: two replicas won one term (the Lease was deleted
or replaced by hand), and this one steps down too. A ConfigMap whose term is newer than
this leader's, or is this term of another identity, found while claiming, deposes it too.
Nothing is ever overwritten on an old version. What this leader wrote is kept in memory
too (it is the only writer while it leads), so :meth:`ConfigMapStore.load` costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from lightkube import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap

from tslice.common import tasks
from tslice.orchestrator.kube import codec
from tslice.orchestrator.persistence import records, store

log = logging.getLogger(__name__)

STATE_LABEL = "timeslice.io/orchestrator-state"
TERM_ANNOTATION = "timeslice.io/leader-term"
LEADER_ANNOTATION = "timeslice.io/leader"
_CONFLICT, _NOT_FOUND = 409, 404


def configmap_name(group_id: str) -> str:
    """A DNS-1123 name for a group's ConfigMap, unique per id (ids may have upper case)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", group_id.lower()).strip("-")[:39].strip("-")
    digest = hashlib.sha256(group_id.encode()).hexdigest()[:10]
    return f"tslice-group-{slug}-{digest}" if slug else f"tslice-group-{digest}"


class NewerTerm(store.Deposed):
    """A ConfigMap was written by a newer leader term (:attr:`term`) than this store's."""

    def __init__(self, message: str, term: int) -> None:
        super().__init__(message)
        self.term = term


def _term_of(cm: Any) -> int:
    try:
        return int((cm.metadata.annotations or {}).get(TERM_ANNOTATION, "0"))
    except ValueError:
        return 0


def _leader_of(cm: Any) -> str:
    return str((cm.metadata.annotations or {}).get(LEADER_ANNOTATION, ""))


async def highest_term(client: Any, namespace: str) -> int:
    """The highest leader term any state ConfigMap in ``namespace`` was written in."""
    return max(
        [
            _term_of(cm)
            async for cm in client.list(
                ConfigMap, namespace=namespace, labels={STATE_LABEL: "group"}
            )
        ],
        default=0,
    )


class ConfigMapStore:
    """A :class:`tslice.orchestrator.persistence.store.LockStore` in ConfigMaps; :meth:`claim`
    it first."""

    def __init__(
        self,
        client: Any,
        *,
        namespace: str,
        term: int,
        identity: str,
        on_deposed: Callable[[str, int], None],
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._term = term
        self._identity = identity
        self._on_deposed = on_deposed
        #: group -> the resourceVersion this leader last read or wrote.
        self._versions: dict[str, str] = {}
        self._persisted: store.Persisted = {}
        self._deletions: list[asyncio.Task[None]] = []
        #: ConfigMap name -> why its record could not be read (at claim).
        self._unreadable: dict[str, str] = {}

    async def claim(self) -> None:
        """Claim every group's ConfigMap for this term and read them; raises
        :class:`NewerTerm` if a newer term already wrote one, :class:`store.StoreError`
        if the API server cannot be read."""
        namespace = self._namespace
        try:
            found = [
                cm
                async for cm in self._client.list(
                    ConfigMap, namespace=namespace, labels={STATE_LABEL: "group"}
                )
            ]
            for cm in found:
                await self._claim(cm)
        except ApiError as err:
            raise store.StoreError(
                f"cannot read the orchestrator state ConfigMaps in {namespace}: "
                f"{err.status.code} {err.status.message} (check the ConfigMap RBAC)"
            ) from err
        log.info("leader term %d: claimed %d group state ConfigMap(s)", self._term, len(found))

    async def _claim(self, cm: Any) -> None:
        while True:
            name = cm.metadata.name
            self._check_writer(cm)
            cm.metadata.annotations = self._stamp(cm.metadata.annotations)
            try:
                cm = await self._client.replace(cm)
                break
            except ApiError as err:
                if err.status.code == _NOT_FOUND:
                    return  # deleted meanwhile
                if err.status.code != _CONFLICT:
                    raise
            # Written meanwhile (a deposed leader's last write): read it again.
            cm = await self._client.get(ConfigMap, name, namespace=self._namespace)
        data = cm.data or {}
        try:
            gid = data["group"]
            nodes = [(str(n), str(a)) for n, a in json.loads(data["nodes"])]
            record = codec.decode(data["record"])
        except (KeyError, ValueError, TypeError) as err:
            log.error(
                "state ConfigMap %s/%s is unreadable (%s): its group's holder will be looked "
                "for on the agents, and the ConfigMap is written anew at the group's next change",
                self._namespace,
                cm.metadata.name,
                err,
            )
            self._unreadable[cm.metadata.name] = str(err)
            return
        self._versions[gid] = str(cm.metadata.resourceVersion)
        self._persisted[gid] = (nodes, record)

    def _stamp(self, annotations: dict[str, str] | None) -> dict[str, str]:
        return {
            **(annotations or {}),
            TERM_ANNOTATION: str(self._term),
            LEADER_ANNOTATION: self._identity,
        }

    def _check_writer(self, cm: Any) -> None:
        """Raise :class:`NewerTerm` if ``cm`` was written in a newer term, or in this
        term by another replica (never adopted: one term, one leader)."""
        name, term, leader = cm.metadata.name, _term_of(cm), _leader_of(cm)
        if term > self._term:
            raise self._deposed(
                term,
                f"leader term {term} wrote state ConfigMap {self._namespace}/{name} after "
                f"this replica's term {self._term}: this replica is no longer the leader",
            )
        if term == self._term and leader != self._identity:
            raise self._deposed(
                term,
                f"{leader or 'another replica'} wrote state ConfigMap {self._namespace}/{name} "
                f"in leader term {term}, this replica's term: two replicas were elected in "
                "one term (the Lease was deleted or replaced by hand?); this one steps down "
                "and campaigns above it",
            )

    def _deposed(self, term: int, why: str) -> NewerTerm:
        self._on_deposed(why, term)
        return NewerTerm(why, term)

    async def load(self) -> store.Persisted:
        return dict(self._persisted)

    def unrecorded(self, group_id: str) -> records.LockRecord:
        """A group without a readable record: new, or its ConfigMap was deleted or left
        unreadable (no way to tell): "nobody holds" could be wrong, so its holder is
        looked for on the agents (``tslice.orchestrator.group.found_holder``)."""
        name = configmap_name(group_id)
        why = self._unreadable.get(name)
        what = (
            f"an unreadable state ConfigMap {self._namespace}/{name} ({why})"
            if why is not None
            else f"no state ConfigMap {self._namespace}/{name} (new, or deleted)"
        )
        log.log(
            logging.INFO if why is None else logging.WARNING,
            "group %s has %s: its holder is taken from the agents (a job resident on every "
            "node keeps the group until it yields)",
            group_id,
            what,
            extra={"group_id": group_id},
        )
        return records.LockRecord.lost()

    def save(
        self, group_id: str, *, nodes: list[tuple[str, str]], changes: records.Changes
    ) -> asyncio.Future[None]:
        """Write the group's record with ``changes`` made: the API server stores a
        ConfigMap whole, so a write is the length of the queue (bounded by
        ``limits.max_waiters_per_group``); one per batch of the group's commands."""
        kept = self._persisted.get(group_id)
        record = records.applied(kept[1] if kept else records.LockRecord.empty(), changes)
        return asyncio.ensure_future(self._write(group_id, nodes, record))

    async def _write(
        self, group_id: str, nodes: list[tuple[str, str]], record: records.LockRecord
    ) -> None:
        name = configmap_name(group_id)
        version = self._versions.get(group_id)
        cm = ConfigMap(
            metadata=ObjectMeta(
                name=name,
                namespace=self._namespace,
                labels={STATE_LABEL: "group"},
                annotations=self._stamp(None),
                resourceVersion=version,
            ),
            data={"group": group_id, "nodes": json.dumps(nodes), "record": codec.encode(record)},
        )
        try:
            written = await (
                self._client.create(cm) if version is None else self._client.replace(cm)
            )
        except ApiError as err:
            if err.status.code == _CONFLICT:
                await self._conflict(group_id, name)
            elif err.status.code == _NOT_FOUND:
                self._versions.pop(group_id, None)  # deleted by hand: created again
            raise store.StoreError(
                f"cannot write state of group {group_id!r} to ConfigMap "
                f"{self._namespace}/{name}: {err.status.code} {err.status.message}"
            ) from err
        except Exception as err:  # unreachable, timed out: the worker retries
            raise store.StoreError(
                f"cannot write state of group {group_id!r} to ConfigMap "
                f"{self._namespace}/{name}: {type(err).__name__}: {err}"
            ) from err
        self._versions[group_id] = str(written.metadata.resourceVersion)
        self._persisted[group_id] = (list(nodes), record)

    async def _conflict(self, group_id: str, name: str) -> None:
        """A 409: deposed if a newer term wrote the ConfigMap, or this term by another
        replica; else adopt its version (a write of this replica's whose answer was lost,
        or an older leader's create of a group this one had not claimed) so that the
        retry goes through."""
        try:
            current = await self._client.get(ConfigMap, name, namespace=self._namespace)
        except ApiError:
            return  # the retry finds out
        self._check_writer(current)
        self._versions[group_id] = str(current.metadata.resourceVersion)

    def forget(self, group_id: str) -> None:
        self._persisted.pop(group_id, None)
        if self._versions.pop(group_id, None) is None:
            return
        name = configmap_name(group_id)
        self._deletions.append(tasks.spawn(self._delete(name), name=f"state:forget:{name}"))

    async def _delete(self, name: str) -> None:
        try:
            await self._client.delete(ConfigMap, name, namespace=self._namespace)
        except Exception as err:
            log.warning("could not delete state ConfigMap %s: %s", name, err)

    async def close(self) -> None:
        if self._deletions:
            await asyncio.gather(*self._deletions, return_exceptions=True)
