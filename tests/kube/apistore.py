"""The object store of the API-server emulator (tests/kube/emulator.py): objects, selectors,
resourceVersions and the event history that watches replay.

Like etcd behind a real API server, one counter numbers every change across all kinds;
each object carries the number of its last change as ``metadata.resourceVersion``, and a
list is consistent at the counter's value. The history keeps every change from
``floor`` on: a watch may resume from any version at or past it, an older one is
answered ``410 Gone`` (``compact()`` moves the floor, as etcd's compaction does).
Writes check ``metadata.resourceVersion`` when the caller sends one (update and
patch): a stale one is a ``409 Conflict``, as optimistic concurrency wants.

Simplifications (the tests need no more): no admission, defaulting or status
subresource rules (a write may set anything), a strategic-merge patch is a JSON merge
patch, no field managers, no finalizers, no pagination.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import datetime
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Obj = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS = {
    k.plural: k
    for k in (
        Kind("", "v1", "nodes", "Node", namespaced=False),
        Kind("", "v1", "pods", "Pod", namespaced=True),
        Kind("", "v1", "configmaps", "ConfigMap", namespaced=True),
        Kind("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True),
    )
}


class ApiFailure(Exception):
    """An error answer: HTTP ``code`` and a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


def gone(version: int) -> ApiFailure:
    return ApiFailure(410, "Expired", f"too old resource version: {version}")


# ---- selectors ----------------------------------------------------------------------------

Predicate = Callable[[Obj], bool]
_SET_TERM = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b=c``)."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return [t.strip() for t in terms if t.strip()]


def label_selector(selector: str | None) -> Predicate:
    """``labelSelector``: ``k``, ``!k``, ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``,
    ``k notin (a,b)``, comma-separated (all must hold)."""
    checks: list[Predicate] = []
    for term in _split_terms(selector or ""):
        m = _SET_TERM.match(term)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                checks.append(lambda o, k=key, vs=values: _labels(o).get(k) in vs)
            else:
                checks.append(lambda o, k=key, vs=values: _labels(o).get(k) not in vs)
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            checks.append(lambda o, k=key, v=value: _labels(o).get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            checks.append(lambda o, k=key, v=value: _labels(o).get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            checks.append(lambda o, k=absent: k not in _labels(o))
        else:
            checks.append(lambda o, k=term: k in _labels(o))
    return lambda obj: all(check(obj) for check in checks)


def _labels(obj: Obj) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def field_value(obj: Obj, path: str) -> str:
    """A field as a field selector compares it: a string ("" when absent; booleans
    ``true``/``false``)."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def field_selector(selector: str | None) -> Predicate:
    """``fieldSelector``: ``path=v``, ``path==v``, ``path!=v`` on any dotted path."""
    checks: list[Predicate] = []
    for term in _split_terms(selector or ""):
        if "!=" in term:
            path, value = (s.strip() for s in term.split("!=", 1))
            checks.append(lambda o, p=path, v=value: field_value(o, p) != v)
        elif "=" in term:
            path, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            checks.append(lambda o, p=path, v=value: field_value(o, p) == v)
        else:
            raise ApiFailure(400, "BadRequest", f"invalid field selector term {term!r}")
    return lambda obj: all(check(obj) for check in checks)


# ---- patches ------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``null`` removes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 ``add``/``replace``/``remove``/``test`` on object paths (no array indices)."""
    result = copy.deepcopy(target)
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")
        ]
        node = result
        for part in parents:
            node = node.setdefault(part, {})
        if op["op"] in ("add", "replace"):
            node[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            node.pop(last, None)
        elif op["op"] == "test" and node.get(last) != op["value"]:
            raise ApiFailure(422, "Invalid", f"test of {op['path']} failed")
    return result


# ---- the store ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
    """One entry of the history: ``type`` ADDED/MODIFIED/DELETED, the object after the
    change (the last state for DELETED) and before it (``None`` for ADDED)."""

    version: int
    type: str
    plural: str
    obj: Obj
    old: Obj | None


Key = tuple[str, str, str]  # plural, namespace ("" for cluster objects), name


class Store:
    """Thread-safe; ``changed`` is notified on every write and every control action."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.version = 1
        #: Oldest version a watch may resume from (older: 410 Gone).
        self.floor = 1
        self._objects: dict[Key, Obj] = {}
        self._history: list[Change] = []
        self._versions: list[int] = []

    # -- reads (hold ``changed`` or not: they take it) --

    def get(self, plural: str, namespace: str, name: str) -> Obj:
        with self.changed:
            obj = self._objects.get((plural, namespace, name))
            if obj is None:
                raise _not_found(plural, name)
            return copy.deepcopy(obj)

    def list(self, plural: str, namespace: str | None, selects: Predicate) -> tuple[int, list[Obj]]:
        with self.changed:
            items = [
                copy.deepcopy(obj)
                for (p, ns, _), obj in sorted(self._objects.items())
                if p == plural and namespace in (None, ns) and selects(obj)
            ]
            return self.version, items

    def changes_after(self, version: int) -> list[Change]:
        """The history after ``version``; raises 410 Gone if it was compacted. Call with
        ``changed`` held."""
        if version < self.floor - 1:
            raise gone(version)
        return self._history[bisect.bisect_right(self._versions, version) :]

    # -- writes --

    def create(self, plural: str, namespace: str, body: Obj) -> Obj:
        kind = KINDS[plural]
        meta = body.setdefault("metadata", {})
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            name = meta["generateName"] + uuid.uuid4().hex[:5]
        if not name:
            raise ApiFailure(422, "Invalid", "metadata.name: Required value")
        with self.changed:
            key = (plural, namespace, name)
            if key in self._objects:
                raise ApiFailure(409, "AlreadyExists", f'{plural} "{name}" already exists')
            body["apiVersion"], body["kind"] = kind.api_version, kind.kind
            meta["name"] = name
            if kind.namespaced:
                meta["namespace"] = namespace
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            return self._commit("ADDED", key, body, old=None)

    def update(self, plural: str, namespace: str, name: str, body: Obj) -> Obj:
        with self.changed:
            old = self._current(plural, namespace, name)
            self._check_version(old, body, plural, name)
            new = copy.deepcopy(body)
            new_meta = new.setdefault("metadata", {})
            for field in ("name", "namespace", "uid", "creationTimestamp"):
                if field in old["metadata"]:
                    new_meta[field] = old["metadata"][field]
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            return self._commit("MODIFIED", (plural, namespace, name), new, old=old)

    def patch(self, plural: str, namespace: str, name: str, patch: Any, content_type: str) -> Obj:
        with self.changed:
            old = self._current(plural, namespace, name)
            if content_type.startswith("application/json-patch+json"):
                new = json_patch(old, patch)
            else:  # merge-patch, and strategic merge treated as a merge patch
                self._check_version(old, patch, plural, name)
                new = merge_patch(old, patch)
            return self.update(plural, namespace, name, _without_version(new))

    def delete(self, plural: str, namespace: str, name: str) -> Obj:
        with self.changed:
            old = self._current(plural, namespace, name)
            del self._objects[(plural, namespace, name)]
            self.version += 1
            last = copy.deepcopy(old)
            last["metadata"]["resourceVersion"] = str(self.version)
            self._record(Change(self.version, "DELETED", plural, last, old))
            return copy.deepcopy(last)

    def compact(self) -> int:
        """Forget the history so far: a watch from an older version gets 410 Gone."""
        with self.changed:
            self.floor = self.version + 1
            self._history.clear()
            self._versions.clear()
            self.changed.notify_all()
            return self.version

    # -- internals (``changed`` held) --

    def _current(self, plural: str, namespace: str, name: str) -> Obj:
        obj = self._objects.get((plural, namespace, name))
        if obj is None:
            raise _not_found(plural, name)
        return obj

    @staticmethod
    def _check_version(old: Obj, body: Any, plural: str, name: str) -> None:
        sent = (
            (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        )
        if sent and sent != old["metadata"]["resourceVersion"]:
            raise ApiFailure(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {plural} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )

    def _commit(self, type_: str, key: Key, obj: Obj, *, old: Obj | None) -> Obj:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self._objects[key] = obj
        self._record(Change(self.version, type_, key[0], copy.deepcopy(obj), old))
        return copy.deepcopy(obj)

    def _record(self, change: Change) -> None:
        self._history.append(change)
        self._versions.append(change.version)
        self.changed.notify_all()


def _without_version(obj: Obj) -> Obj:
    obj = copy.deepcopy(obj)
    obj.get("metadata", {}).pop("resourceVersion", None)
    return obj


def _not_found(plural: str, name: str) -> ApiFailure:
    return ApiFailure(404, "NotFound", f'{plural} "{name}" not found')


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def matching(
    changes: Iterable[Change], plural: str, namespace: str | None, selects: Predicate
) -> Iterator[tuple[str, Obj]]:
    """Watch events of ``changes`` as a selecting watch sees them: an object that starts
    matching is ADDED, one that stops matching is DELETED (as the API server does)."""
    for c in changes:
        if c.plural != plural:
            continue
        ns = c.obj.get("metadata", {}).get("namespace", "")
        if namespace is not None and ns != namespace:
            continue
        now = selects(c.obj) if c.type != "DELETED" else False
        before = c.old is not None and selects(c.old)
        if c.type == "DELETED" and before:
            yield "DELETED", c.obj
        elif now and before:
            yield "MODIFIED", c.obj
        elif now:
            yield "ADDED", c.obj
        elif before:
            yield "DELETED", c.obj
