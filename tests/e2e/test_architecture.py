"""The house rules of docs/architecture.md, checked on the source: which package may import which, no import
cycles between modules, no module so long that it holds several jobs, no function too long or taking too many
parameters outside the CLI, and one package per stage in tqsdeploy/."""

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
MAX_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
MAX_TOP_LEVEL_MODULES = 8


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


def _functions(package: str):
    for name, path in MODULES.items():
        if name.split(".")[0] != package or name.startswith("tqsdeploy.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


@pytest.mark.parametrize("package", PACKAGES)
def test_functions_outside_the_cli_stay_short_and_take_few_parameters(package):
    """A command's options may be many (typer needs one parameter each); the library's functions take settings
    objects instead, and a function past `MAX_FUNCTION_LINES` holds several steps that want names of their own."""
    long, wide = [], []
    for module, node in _functions(package):
        arguments = node.args
        count = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
        count -= bool(arguments.args) and arguments.args[0].arg in ("self", "cls")
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
            long.append(f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
        if count > MAX_PARAMETERS:
            wide.append(f"{module}.{node.name} ({count} parameters)")
    assert not long and not wide, (long, wide)


def test_tqsdeploy_keeps_one_package_per_stage():
    modules = sorted(p.name for p in (REPO / "tqsdeploy").glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    assert {"cli", "rollout", "sweep", "scoring", "encoding", "export", "evaluation"} <= {
        p.name for p in (REPO / "tqsdeploy").iterdir() if (p / "__init__.py").exists()
    }
