"""The docs' snippets run as written: every YAML block validates with the real config
loader it is for, every `tslice ...` command line parses with the real command line, the
flag tables list exactly the flags there are, and the log fields are the ones written."""

from __future__ import annotations

import ast
import json
import logging
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
import yaml

from tslice.agent import app as agent_app
from tslice.agent import channel
from tslice.agent import config as agent_config
from tslice.cli import main
from tslice.orchestrator import config as orch_config
from tslice.server import logs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    ROOT / "docs" / "deployment.md",
    ROOT / "docs" / "operations.md",
    ROOT / "docs" / "deploy-kubernetes.md",
    ROOT / "docs" / "deploy-bare-metal.md",
    ROOT / "docs" / "deploy-slurm.md",
    ROOT / "docs" / "demo.md",
]
#: Pages whose YAML blocks are Kubernetes manifests, not tslice config files.
_MANIFEST_PAGES = {ROOT / "docs" / "deploy-kubernetes.md"}
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_AGENT_ONLY_KEYS = {
    "backend_settings",
    "sim",
    "node_name",
    "default_backend",
    "backends",
    "unix_socket",
    "register_socket",
}


def blocks(language: str) -> Iterator[tuple[str, str]]:
    """(``file:line``, text) of every fenced block in ``language``."""
    for path in DOCS:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            if match.group(1) == language and not (language == "yaml" and path in _MANIFEST_PAGES):
                line = text.count("\n", 0, match.start()) + 1
                yield f"{path.relative_to(ROOT)}:{line}", match.group(2)


def ids(items: list[tuple[str, str]]) -> list[str]:
    return [where for where, _ in items]


YAML_BLOCKS = list(blocks("yaml"))


def tslice_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for where, text in blocks("bash"):
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[-1] == "&":
                words = words[:-1]
            if ">" in words:  # a redirection of the command's output
                words = words[: words.index(">")]
            if words and words[0] in ("tslice", ".venv/bin/tslice"):
                commands.append((where, words[1:]))
    return commands


COMMANDS = tslice_commands()


def command(name: str) -> typer.main.TyperCommand:
    return typer.main.get_command(main.app).commands[name]  # type: ignore[attr-defined,no-any-return]


def flags(name: str) -> set[str]:
    return {
        opt
        for param in command(name).params
        for opt in getattr(param, "opts", [])
        if opt.startswith("--") and opt != "--help"
    }


def test_the_docs_have_snippets() -> None:
    assert len(YAML_BLOCKS) >= 2 and len(COMMANDS) >= 6


@pytest.mark.parametrize(("where", "text"), YAML_BLOCKS, ids=ids(YAML_BLOCKS))
async def test_yaml_snippet_validates(where: str, text: str, tmp_path: Path) -> None:
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f"{where}: not a mapping"
    path = tmp_path / "snippet.yaml"
    path.write_text(text)
    if {"groups", "mode", "nodes"} & set(data):
        orch_config.load_topology(path)
    elif _AGENT_ONLY_KEYS & set(data):
        # Every backend the snippet configures is enabled and really built.
        overrides = {
            "state_dir": str(tmp_path / "agent"),
            "backends": list(data.get("backend_settings", {})),
        }
        cfg = agent_config.load(path=path, overrides=overrides)
        built = await agent_app.build_backends(cfg, hub=channel.ChannelHub())
        try:
            assert set(cfg.backend_settings) <= set(built)
        finally:
            for backend in built.values():
                await backend.close()
    else:
        overrides = (
            {}
            if {"topology", "topology_file", "local_agents", "slurm"} & set(data)
            else {"local_agents": ["node-a=127.0.0.1:9001"]}
        )
        orch_config.build(config_file=path, overrides=overrides)


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=ids(COMMANDS))
def test_command_line_parses(where: str, args: list[str]) -> None:
    group = typer.main.get_command(main.app)
    if args == ["--version"]:
        return
    name, rest = args[0], args[1:]
    assert name in group.commands, f"{where}: no command `tslice {name}`"  # type: ignore[attr-defined]
    command(name).make_context(name, rest)  # raises on an unknown flag or a bad value


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize("name", ["orchestrator", "agent", "up"])
def test_flag_lists_match_the_commands(name: str) -> None:
    deployment = ROOT / "docs" / "deployment.md"
    if name == "up":
        text = _section(deployment, "`tslice up` options:")
        text = text.split("\n\n")[0]
    else:
        text = _section(deployment, f"### `tslice {name}` flags")
        text = "\n".join(row.split("|")[1] for row in text.splitlines() if row.startswith("| `"))
    documented = set(re.findall(r"--[a-z][a-z-]*", text))
    assert documented - flags(name) == set(), f"documented flags `tslice {name}` does not have"
    assert flags(name) - documented == set(), f"flags of `tslice {name}` not documented"


@pytest.mark.parametrize(
    ("name", "page", "heading"),
    [
        ("plan", "demo.md", "## Planning placements (`tslice plan`)"),
        ("events", "observability.md", "### `tslice events`"),
    ],
)
def test_flag_tables_of_plan_and_events(name: str, page: str, heading: str) -> None:
    text = _section(ROOT / "docs" / page, heading)
    rows = "\n".join(row.split("|")[1] for row in text.splitlines() if row.startswith("| `"))
    documented = set(re.findall(r"--[a-z][a-z-]*", rows))
    # A switch's secondary name (--no-simulate) is documented beside its first.
    secondary = {
        opt for param in command(name).params for opt in getattr(param, "secondary_opts", [])
    }
    assert documented == flags(name) | secondary, documented ^ (flags(name) | secondary)


def _extra_keys() -> set[str]:
    """Every key the source passes in ``extra={...}`` to a log call."""
    keys: set[str] = set()
    for path in (ROOT / "src" / "tslice").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "extra" and isinstance(kw.value, ast.Dict):
                        keys |= {k.value for k in kw.value.keys if isinstance(k, ast.Constant)}
    return keys


def test_log_fields_are_as_documented() -> None:
    text = _section(ROOT / "docs" / "operations.md", "Logs are JSON lines")
    named = set(re.findall(r"`([a-z][a-z_]*)`", text))
    levels = {"debug", "info", "warning", "error", "critical"}
    record = logging.LogRecord("tslice.x", logging.INFO, __file__, 1, "hello", None, None)
    base = set(json.loads(logs.JsonFormatter().format(record)))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.LogRecord(
            "tslice.x", logging.ERROR, __file__, 1, "x", None, sys.exc_info()
        )
    with_exc = set(json.loads(logs.JsonFormatter().format(failed)))
    assert base | with_exc <= named, "a field every log line has is not documented"
    context = named - base - with_exc - levels
    assert context, "no context fields documented"
    assert context - _extra_keys() == set(), "documented log fields that no log call sets"
