"""The package's shape, checked on the import graph (grimp, which import-linter uses): no
import cycle anywhere, the root package imported by nothing inside it, and modules kept
small (the layers themselves are import-linter's contracts in pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

SRC = Path(__file__).resolve().parents[1] / "src" / "tslice"
#: The most lines a module may have.
MAX_LINES = 600


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("tslice", include_external_packages=False)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    modules = sorted(m for m in graph.modules if not m.startswith("tslice.api"))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:
        nonlocal counter
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in modules:
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_another_that_imports_it_back() -> None:
    """Not even under TYPE_CHECKING, nor through other modules: a cycle is a load-order
    trap and a sign that two modules share one concept."""
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(name)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.d")
    graph.add_import(importer="a.d", imported="a.b")
    assert _cycles(graph) == [["a.b", "a.c", "a.d"]]


def test_nothing_inside_the_package_imports_the_root_package() -> None:
    """The root package imports the client: a module of the client (or of anything the
    client imports) importing ``tslice`` would load it half-initialised."""
    importers = _graph().find_modules_that_directly_import("tslice")
    assert sorted(m for m in importers if m != "tslice.__main__") == []


def test_modules_stay_small() -> None:
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text().splitlines())
        for path in SRC.rglob("*.py")
        if "api" not in path.relative_to(SRC).parts
    }
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines (split them by concept): {over}"


TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path, root: Path) -> set[str]:
    """Dotted names of every module ``path`` imports (at any depth, relative ones resolved
    against the package ``path`` sits in), with ``from pkg import name`` counted as both
    ``pkg`` and ``pkg.name`` since ``name`` may be a module."""
    package = ".".join((root.name, *path.relative_to(root).parent.parts))
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _test_module_imports(root: Path) -> list[str]:
    """``importer -> imported`` for each module under ``root`` that imports a test module
    (a ``test_*.py`` file under ``root``)."""
    modules = {
        ".".join((root.name, *path.relative_to(root).with_suffix("").parts)): path
        for path in root.rglob("*.py")
    }
    tests = {name for name, path in modules.items() if path.name.startswith("test_")}
    return sorted(
        f"{name} -> {imported}"
        for name, path in modules.items()
        for imported in _imported_modules(path, root)
        if imported in tests and imported != name
    )


def test_no_test_module_is_imported_by_another_module() -> None:
    """What tests share (helpers, fixtures, servers) lives in support modules whose names do
    not start with ``test_``: importing a test module runs its collection-time code and
    couples two suites that pytest treats as independent."""
    assert _test_module_imports(TESTS) == []


def test_the_test_import_check_finds_each_form_of_import(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    (root / "a").mkdir(parents=True)
    for name in ("__init__.py", "a/__init__.py", "a/support.py", "a/test_x.py"):
        (root / name).write_text("")
    (root / "a" / "test_y.py").write_text(
        "from tests.a.support import thing\ndef f():\n    from tests.a.test_x import helper\n"
    )
    (root / "a" / "test_z.py").write_text("from .test_x import helper\n")
    (root / "a" / "conftest.py").write_text("from tests.a import test_x\n")
    (root / "test_w.py").write_text("import tests.a.test_x\n")
    assert _test_module_imports(root) == [
        "tests.a.conftest -> tests.a.test_x",
        "tests.a.test_y -> tests.a.test_x",
        "tests.a.test_z -> tests.a.test_x",
        "tests.test_w -> tests.a.test_x",
    ]
