"""The whole source tree, not one module: the package layers point down only
(docs/architecture.md): every import of every module, read from the source without running it,
is checked against the allowed edges, and the module graph has no cycle. Function-level (lazy)
imports count like top-level ones, and so do modules spelled in strings to be run as
`python -m MODULE` (a subprocess imports them all the same)."""

import ast
import functools
import re
import sys
from pathlib import Path

import pytest
from graph_helpers import find_cycle

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "trainer", "diag", "analysis", "depthdiag")

ALLOWED_PACKAGES = {
    "common": set(),
    "trainer": {"common"},
    "diag": {"common", "trainer", "analysis"},
    "analysis": {"common"},
    "depthdiag": {"common", "trainer", "diag", "analysis"},
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


RUN_AS_MODULE = re.compile(r"""-m["',\s]+([A-Za-z_][\w.]*)""")
"""`-m NAME` in a command line, written as one string or as list items ("-m", "NAME")."""


def modules_run_in(text: str) -> set[str]:
    """The project modules `text` runs as `python -m NAME`."""
    return {name for name in RUN_AS_MODULE.findall(text) if name.split(".")[0] in PACKAGES}


def code_strings(tree: ast.Module) -> str:
    """The module's string constants other than docstrings (which describe, not run), in order."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    constants = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]
    return " ".join(node.value for node in sorted(constants, key=lambda n: (n.lineno, n.col_offset)))


REMOTE_CODE_TEMPLATES = ROOT / "trainer" / "export" / "hf"
"""The modules an hf export copies into its folder, where only relative imports work (they
resolve to their absolute names here)."""


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name `path` imports, anywhere in the file, or runs with `-m`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = modules_run_in(code_strings(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                assert path.parent == REMOTE_CODE_TEMPLATES, f"{path}: relative import (the tree uses absolute imports)"
                base = module_name(path).rsplit(".", node.level)[0]
                module = f"{base}.{module}" if module else base
            found.add(module)
            # `from package import module` imports the submodule too.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = project_modules()


@functools.cache
def project_imports() -> dict[str, set[str]]:
    """Module -> what it imports; parsed when a test first asks, not when pytest collects this
    file (every worker collects it, one runs it)."""
    return {name: imported_modules(path) for name, path in MODULES.items()}


def test_every_package_has_modules():
    assert {name.split(".")[0] for name in MODULES} == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_only(package):
    violations = []
    for name, imports in project_imports().items():
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
    for name, imports in project_imports().items():
        if name.split(".")[0] == "common":
            outside = {i.split(".")[0] for i in imports} - set(sys.stdlib_module_names) - {"common", "tqdm"}
            assert not outside, f"{name} imports {sorted(outside)}"


def module_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (a package's import means its __init__)."""
    return {name: {i for i in imports if i in MODULES and i != name} for name, imports in project_imports().items()}


def test_no_import_cycles():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def runnable(name: str) -> bool:
    """Whether `python -m name` finds something to run: a module, or a package with __main__."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def test_every_module_run_with_dash_m_exists():
    sources = [*ROOT.glob("*/*.py"), *ROOT.glob("*/*/*.py"), ROOT / "Makefile", ROOT / ".ci" / "run"]
    sources += [*(ROOT / "bench").glob("*.sh"), *ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]
    missing = sorted(
        f"{path.relative_to(ROOT)}: -m {name}"
        for path in sources
        if ".venv" not in path.parts and "mutants" not in path.parts and path != Path(__file__).resolve()
        for name in modules_run_in(path.read_text())
        if not runnable(name)
    )
    assert not missing, "\n".join(missing)


def test_a_module_run_in_a_string_counts_as_an_import():
    assert modules_run_in("torchrun --nproc_per_node=2 -m depthdiag train") == {"depthdiag"}
    assert modules_run_in('[sys.executable, "-m", "depthdiag.cli", "train"]') == {"depthdiag.cli"}
    assert modules_run_in("python -m pytest -m slow") == set()
    tree = ast.parse('"""Run it as python -m depthdiag."""\nCOMMAND = ["-m", "diag.driver.run"]')
    assert modules_run_in(code_strings(tree)) == {"diag.driver.run"}


ROOMS = ("diag.arithmetic", "diag.sources", "diag.in_training", "diag.driver")
ROOMS_NOT_IMPORTED = {
    "diag.arithmetic": {"diag.sources", "diag.in_training", "diag.driver"},
    "diag.sources": {"diag.in_training", "diag.driver"},
    "diag.in_training": {"diag.driver"},
    "diag.driver": {"diag.in_training"},
}
"""Inside diag/ the rooms point one way: the arithmetic takes one form of a model and knows no
model source; the sources turn every input into that form and never drive a run; the driver
and the in-training side use both and not each other."""


def room_of(module: str) -> str | None:
    return next((room for room in ROOMS if module == room or module.startswith(room + ".")), None)


def test_diags_modules_all_live_in_a_room():
    loose = sorted(name for name in MODULES if name.startswith("diag.") and room_of(name) is None)
    assert not loose, f"modules of diag/ outside its rooms {ROOMS}: {loose}"


def test_diags_rooms_point_one_way():
    violations = sorted(
        f"{name} imports {imported}"
        for name, imports in project_imports().items()
        if (room := room_of(name)) is not None
        for imported in imports
        if room_of(imported) in ROOMS_NOT_IMPORTED[room]
    )
    assert not violations, "\n".join(violations)


def test_no_test_file_imports_another_test_file():
    """Test files share code through helper modules (tests/helpers.py, hf_helpers.py, grid_helpers.py),
    never by importing one another: an import of a test_*.py runs that file's module code (its skips,
    its fixtures, its constants) inside another file and ties the two together."""
    test_files = sorted((ROOT / "tests").glob("test_*.py"))
    test_modules = {path.stem for path in test_files}
    found = []
    for path in test_files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(
                node, ast.ImportFrom
            ):  # from test_x import y, from tests.test_x import y, from . import test_x
                names = [f"{node.module or ''}.{alias.name}" for alias in node.names]
            else:
                continue
            found += [
                f"{path.name}:{node.lineno} imports {name.strip('.')}"
                for name in names
                if test_modules & set(name.split("."))
            ]
    assert not found, "test files import other test files (move the shared code to a helper module):\n" + "\n".join(
        found
    )
