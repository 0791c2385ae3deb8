"""JSON logging (stdlib) for servers: one object per line, extra fields kept.

Every line carries the ids of what it is about: those passed as ``extra``, those of the
task that logs (:data:`IDS`: a switch binds its group, jobs and grant epoch, an agent's
operation its job, group and operation id), the process's own (``setup(static=...)``:
the agent's node) and, while tracing is on, the trace and span ids. Binding is one
``IDS.set({...})`` (a C call) at the start of a task: the ids are read only when a line
is written.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
import types
from collections.abc import Mapping
from typing import Any

from tslice.server import tracing

#: The ids of the work the current task does (set once at the task's start; a task
#: spawned later inherits them).
IDS: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "tslice_log_ids", default=types.MappingProxyType({})
)

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, static: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        #: Fields of every line of this process (the agent's node).
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
            **IDS.get(),
        }
        if tracing.ENABLED:
            payload.update(tracing.ids())
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time (not when the handler was made),
    so a redirected or replaced stderr (test runners, CLI runners) never gets a write to a
    closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def setup(
    level: str = "info", *, json_format: bool = True, static: Mapping[str, Any] | None = None
) -> None:
    """Configure the root logger once for a server process (``static``: fields of every
    line, e.g. the agent's node)."""
    handler = _StderrHandler()
    if json_format:
        handler.setFormatter(JsonFormatter(static))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
