"""The package map stays a map: read every module's imports (ast, nothing is executed) and check that packages
depend on each other in one direction (each only on the rows below its own in docs/architecture.md's diagram),
that library code never reaches up into the command line or the benchmark scripts, and that imports inside
functions are only those of optional dependencies."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# imported inside functions on purpose: heavy or optional third-party packages (each place says why)
OPTIONAL = ("transformers", "sglang", "triton", "matplotlib", "yaml", "prometheus_client", "flashinfer",
            "fastapi")  # fastapi: sglang's HTTP layer, there only with sglang
# the rows of the package diagram in docs/architecture.md, top first: a package imports only rows below its own
LAYERS = (
    ("cli", "sglang_plugin"),
    ("catalog",),
    ("train",),
    ("models", "decode", "device_trees"),
    ("mtp", "kernels"),
    ("attention", "verify"),
    ("tree",),
    ("costs", "planner"),
    ("sampling", "files", "gemm"),
    ("errors",),
)


@dataclass(frozen=True)
class Import:
    module: str  # importing module, e.g. sglang_spec.tree.batch
    target: str  # imported module, e.g. sglang_spec.errors
    in_function: bool


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((REPO / "sglang_spec").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text())
    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    in_function = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    result = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module]
        elif isinstance(node, ast.ImportFrom):  # relative: from . import x, from .x import y
            base = ".".join(package_parts[: len(package_parts) - node.level + 1])
            targets = [f"{base}.{node.module}"] if node.module else [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        result += [Import(module, target, id(node) in in_function) for target in targets]
    return result


def all_imports() -> list[Import]:
    return [item for module, path in module_files().items() for item in imports_of(module, path)]


def package(module: str) -> str:
    """sglang_spec.tree.batch -> tree; top-level modules (sglang_spec.errors) are their own node."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "sglang_spec"


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for item in all_imports():
        if item.target.startswith("sglang_spec.") and package(item.module) != package(item.target):
            graph.setdefault(package(item.module), set()).add(package(item.target))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_scan_sees_the_packages():
    graph = package_graph()
    assert {"tree", "verify", "decode", "mtp", "train", "cli", "kernels"} <= set(graph)
    assert "tree" in graph["verify"] and "errors" in graph["tree"]


def test_package_dependencies_have_no_cycle():
    cycle = find_cycle(package_graph())
    assert not cycle, " -> ".join(cycle)


def test_packages_import_only_rows_below_their_own():
    row = {name: number for number, names in enumerate(LAYERS) for name in names}
    graph = package_graph()
    unplaced = sorted(({*graph} | {*(target for targets in graph.values() for target in targets)}) - set(row))
    assert not unplaced, f"not in LAYERS (nor in docs/architecture.md's diagram): {unplaced}"
    upward = sorted(f"{source} imports {target}" for source, targets in graph.items() for target in targets
                    if row[target] <= row[source])
    assert not upward, upward


def test_nothing_imports_the_command_line_or_the_benchmarks():
    bench_modules = {"bench", *(path.stem for path in (REPO / "bench").glob("*.py"))}
    wrong = [
        f"{item.module} imports {item.target}"
        for item in all_imports()
        if (item.target.startswith("sglang_spec.cli") and package(item.module) != "cli")
        or item.target.split(".")[0] in bench_modules
    ]
    assert not wrong, wrong


def test_imports_inside_functions_are_optional_dependencies_only():
    hidden = [
        f"{item.module} imports {item.target} inside a function"
        for item in all_imports()
        if item.in_function and item.target.split(".")[0] not in OPTIONAL
    ]
    assert not hidden, hidden
