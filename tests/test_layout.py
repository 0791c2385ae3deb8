"""The package's shape, checked on the import graph (grimp, which import-linter uses): no
import cycle anywhere, the root package imported by nothing inside it, and modules kept
small (the layers themselves are import-linter's contracts in pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

import grimp

SRC = Path(__file__).resolve().parents[1] / "src" / "tslice"
#: The most lines a module may have.
MAX_LINES = 600
#: Modules still over it, with their size when this list was written: each may only shrink
#: (issue 17 brings them under the limit; then they leave this list).
OVER_THE_LIMIT = {
    "orchestrator/group/lock.py": 650,
    "orchestrator/group/driver.py": 754,
}


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
    grown = {
        n: (lines, OVER_THE_LIMIT.get(n))
        for n, lines in over.items()
        if lines > OVER_THE_LIMIT.get(n, MAX_LINES)
    }
    assert grown == {}, f"modules over {MAX_LINES} lines (or grown past their mark): {grown}"
