"""The package layers point down only (docs/architecture.md): every import of every module,
read from the source without running it, is checked against the allowed edges, and the
module graph has no cycle. Function-level (lazy) imports count like top-level ones."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "trainer", "diag", "analysis")

ALLOWED_PACKAGES = {
    "common": set(),
    "trainer": {"common"},
    "diag": {"common", "trainer", "analysis"},
    "analysis": {"common"},
}
"""Which sibling packages each package may import (besides itself)."""
FORBIDDEN_THIRD_PARTY = {
    "common": {"torch", "xarray", "numpy", "h5py", "h5netcdf"},
    "analysis": {"torch"},
}
"""Libraries a layer must not import: common stays light enough for `--help` and analysis
reads result files without a model."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name `path` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the tree uses absolute imports)"
            found.add(node.module)
            # `from package import module` imports the submodule too.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = project_modules()
IMPORTS = {name: imported_modules(path) for name, path in MODULES.items()}


def test_every_package_has_modules():
    assert {name.split(".")[0] for name in MODULES} == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_only(package):
    violations = []
    for name, imports in IMPORTS.items():
        if name.split(".")[0] != package:
            continue
        for imported in imports:
            top = imported.split(".")[0]
            if top in PACKAGES and top != package and top not in ALLOWED_PACKAGES[package]:
                violations.append(f"{name} imports {imported}")
            if top in FORBIDDEN_THIRD_PARTY.get(package, set()):
                violations.append(f"{name} imports {imported}")
    assert not violations, "\n".join(violations)


def test_common_uses_only_the_standard_library_and_tqdm():
    for name, imports in IMPORTS.items():
        if name.split(".")[0] == "common":
            outside = {i.split(".")[0] for i in imports} - set(sys.stdlib_module_names) - {"common", "tqdm"}
            assert not outside, f"{name} imports {sorted(outside)}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the project's modules as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def module_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (a package's import means its __init__)."""
    return {name: {i for i in imports if i in MODULES and i != name} for name, imports in IMPORTS.items()}


def test_no_import_cycles():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
