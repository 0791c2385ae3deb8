"""The job side imports nothing of the ``server`` extra: it lives in other people's
training processes, where only grpcio and protobuf may be assumed.

Each check runs in a fresh interpreter, so that what this test process (pytest, the
fixtures) imported does not count. In the floor and newest venvs (`make test-floor`,
`make test-newest`) the server extra is not even installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

#: Import names of the ``server`` extra (tslice/__main__.py keeps the same list).
SERVER_PACKAGES = (
    "pydantic",
    "typer",
    "rich",
    "prometheus_client",
    "httpx",
    "yaml",
    "grpc_health",
    "grpc_reflection",
)
#: grpcio's own ``grpc/__init__.py`` imports these bare packages when they are installed
#: (to alias them as ``grpc.health``/``grpc.reflection``); their modules are what counts.
IMPORTED_BY_GRPCIO = ("grpc_health", "grpc_reflection")
JOB_SIDE = ("tslice", "tslice.api", "tslice.client", "tslice.workload", "tslice.rl")
SERVER_SIDE = ("tslice.agent", "tslice.orchestrator", "tslice.cli", "tslice.sim")
#: Frameworks an integration module may need. They are hidden from the fresh interpreter
#: (as in the floor venv, where none is installed): what they import themselves (e.g.
#: transformers imports yaml) is theirs, and tslice must import none of it on its own.
OPTIONAL = ("torch", "numpy", "transformers", "trl", "ray", "verl", "slime", "vllm", "sglang")

# Imports every module of the job-side packages (walking their subpackages) and prints
# what ended up in sys.modules, and which modules wanted a (hidden) optional framework.
_SCRIPT = """
import importlib, importlib.abc, json, pkgutil, sys
roots, optional = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in optional:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return None

sys.meta_path.insert(0, Hide())
wanted = {}
def load(name):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        # the framework's own ModuleNotFoundError, perhaps under a clearer ImportError
        cause = exc
        while cause is not None and not isinstance(cause, ModuleNotFoundError):
            cause = cause.__cause__ or cause.__context__
        top = (getattr(cause, "name", None) or "").split(".")[0]
        if top not in optional:
            raise
        wanted[name] = top
for root in roots:
    module = load(root)
    if module is None or root == "tslice":
        continue
    for info in pkgutil.walk_packages(module.__path__, prefix=root + "."):
        load(info.name)
print(json.dumps({"modules": sorted(sys.modules), "wanted": wanted}))
"""


def _import_job_side() -> tuple[list[str], dict[str, str]]:
    roots = [name for name in JOB_SIDE if importlib.util.find_spec(name) is not None]
    assert "tslice.client" in roots and "tslice.workload" in roots
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(roots), json.dumps(OPTIONAL)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    return report["modules"], report["wanted"]


def test_the_job_side_imports_nothing_of_the_server_extra() -> None:
    modules, wanted = _import_job_side()
    offending = [
        name
        for name in modules
        if name.split(".")[0] in SERVER_PACKAGES and name not in IMPORTED_BY_GRPCIO
    ]
    assert not offending, f"the job side imported server-extra modules: {offending}"
    server_side = [name for name in modules if name.startswith(tuple(f"{p}." for p in SERVER_SIDE))]
    server_side += [name for name in modules if name in SERVER_SIDE]
    assert not server_side, f"the job side imported server modules: {server_side}"
    # Only integration modules may need a framework at import time (e.g. the TorchAdapter).
    core = ("tslice.api", "tslice.client", "tslice.common", "tslice.rl.phases")
    assert not [name for name in wanted if name.startswith(core)], wanted
    assert "tslice.rl" not in wanted and "tslice.workload" not in wanted, wanted


def test_the_command_without_the_server_extra_says_how_to_install_it() -> None:
    script = (
        "import tslice.__main__ as entry\n"
        "entry.SERVER_MODULES = ('typer', 'tslice_no_such_module')\n"
        "entry.main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "tslice_no_such_module" in lines[0]
    assert "pip install 'tslice[server]'" in lines[0]


def test_python_m_tslice_runs_or_names_the_extra() -> None:
    """With the extra (main venv) the command works; without it (floor venv) it says so."""
    done = subprocess.run(
        [sys.executable, "-m", "tslice", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        assert done.returncode == 2, done.stderr
        assert "pip install 'tslice[server]'" in done.stderr
        assert all(name in done.stderr for name in missing)
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("tslice ")


def test_the_job_side_depends_on_grpcio_and_protobuf_only() -> None:
    """What `pip install tslice` pulls: nothing else (extras aside) — pinned from the metadata."""
    from importlib.metadata import requires

    declared = [r for r in requires("tslice") or [] if "extra ==" not in r]
    names = sorted(
        r.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip() for r in declared
    )
    assert names == ["grpcio", "protobuf"], declared


def test_typing_extensions_is_imported_for_the_type_checker_only() -> None:
    """No module of tslice imports typing_extensions at run time (grpcio 1.60 does not bring it)."""
    import ast
    import pathlib

    import tslice

    root = pathlib.Path(tslice.__file__).parent
    offending = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        guarded = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if (
                any(n.split(".")[0] == "typing_extensions" for n in names)
                and id(node) not in guarded
            ):
                offending.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offending, f"typing_extensions imported at run time: {offending}"
