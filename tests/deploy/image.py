"""What the Dockerfile says about the image, for the tests of the image and of the
manifests that run it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def text() -> str:
    return DOCKERFILE.read_text()


def venv_bin() -> str:
    """The directory of the image's ``tslice`` (first on the image's PATH)."""
    (path,) = re.findall(r"^ENV PATH=([^:\s]+):\$PATH", text(), re.M)
    return path


def user() -> int:
    """The image's (numeric) user."""
    (uid,) = re.findall(r"^USER (\d+):\d+$", text(), re.M)
    return int(uid)
