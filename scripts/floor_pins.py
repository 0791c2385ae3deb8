"""Print the job side's floors as pins (``grpcio==1.60 ...``) for `make test-floor`.

Read from ``[project] dependencies`` in pyproject.toml, so that the floor CI tests is the
floor users are promised: every dependency must have a ``>=`` floor. Pins given as
arguments replace the floor of their package (``floor_pins.py protobuf==5.26.1``).
"""

from __future__ import annotations

import pathlib
import re
import sys

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
_REQUIREMENT = re.compile(r"^([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(,.*)?$")


def floor_pins(text: str) -> list[str]:
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.M | re.S)
    if block is None:
        raise SystemExit("pyproject.toml: no [project] dependencies list")
    pins = []
    for requirement in re.findall(r'"([^"]+)"', block.group(1)):
        match = _REQUIREMENT.match(requirement)
        if match is None:
            raise SystemExit(f"pyproject.toml: {requirement!r} has no >= floor to test")
        pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


def main() -> None:
    pins = {pin.split("==")[0].lower(): pin for pin in floor_pins(PYPROJECT.read_text())}
    for override in sys.argv[1:]:
        name = override.split("==")[0].lower()
        if name not in pins:
            raise SystemExit(f"{override!r}: not a dependency of the job side")
        pins[name] = override
    print(" ".join(pins.values()))


if __name__ == "__main__":
    sys.exit(main())
