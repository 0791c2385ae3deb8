"""Print tslice's requirements (the core ones and those of the named extras), one a line.

For a venv whose dependencies are installed before tslice itself (CI makes the oldest
Python's venv in the background while `make test` runs; tslice goes in afterwards with
``--no-deps``, as two editable builds of one tree at once would share its egg-info).
Usage: ``requirements.py server,dev``.
"""

from __future__ import annotations

import pathlib
import sys

import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project["optional-dependencies"]
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"no such extra in pyproject.toml: {', '.join(unknown)}")
    return [*project["dependencies"], *(r for name in extras for r in optional[name])]


if __name__ == "__main__":
    wanted = [name for arg in sys.argv[1:] for name in arg.split(",") if name]
    print("\n".join(requirements(wanted)))
