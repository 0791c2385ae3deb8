"""The package's version, in a module of its own: the client sends it in a header and the
CLI prints it, and neither imports the root package (which imports the client)."""

from __future__ import annotations

VERSION = "0.1.0"
