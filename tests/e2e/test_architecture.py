"""The house rules of docs/architecture.md, checked on the source: which package may import which, no import
cycles between modules, and no module so long that it holds several jobs."""

import ast
from pathlib import Path

import pytest
from conftest import REPO

PACKAGES = ("tqsdeploy", "graph_ops", "runtimes", "tiers")
ALLOWED = {
    "tqsdeploy": set(PACKAGES),
    "runtimes": {"runtimes", "graph_ops"},
    "tiers": {"tiers", "graph_ops"},
    "graph_ops": {"graph_ops"},
}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _top_level_imports(name: str, path: Path) -> set[str]:
    """Modules of ours imported when `name` is imported: module-level statements only (an import inside a function
    runs later and cannot make a cycle at import time)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks never run
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def test_packages_import_only_downwards():
    wrong = []
    for name, path in MODULES.items():
        own = name.split(".")[0]
        for imported in _top_level_imports(name, path):
            if imported.split(".")[0] not in ALLOWED[own]:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, wrong


def test_no_import_cycles_between_modules():
    graph = {
        name: {m for m in _top_level_imports(name, path) if not name.startswith(m + ".")}
        for name, path in MODULES.items()
    }
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]) if nxt in trail else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_holds_several_jobs(package):
    long = {
        name: n
        for name, path in MODULES.items()
        if name.split(".")[0] == package and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
