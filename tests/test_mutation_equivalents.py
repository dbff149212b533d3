"""The reasons in tests/mutation/equivalent.toml describe the current code: every entry names a
function that exists, and the line its mutant changes is still in that function (the report of
`make mutants` marks such an entry stale only after a three-hour run; this says so at once)."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = tomllib.loads((ROOT / "tests" / "mutation" / "equivalent.toml").read_text(encoding="utf-8"))["equivalent"]


def function_source(name: str) -> str | None:
    """The source of mutmut's function `name` (module.x_function or module.xǁClassǁmethod), or None."""
    module, _, mangled = name.rpartition(".")
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        return None
    source = path.read_text(encoding="utf-8")
    if mangled.startswith("xǁ"):
        class_name, _, function = mangled[2:].partition("ǁ")
        scopes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name]
        body = scopes[0].body if scopes else []
    else:
        function, body = mangled[2:], ast.parse(source).body
    found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    # whole lines, so that a comment ending the function's last line is in it, as in mutmut's diff
    return "\n".join(source.splitlines()[found[0].lineno - 1 : found[0].end_lineno]) if found else None


def test_every_equivalent_mutant_names_a_function_and_a_line_of_the_current_code():
    stale = []
    for entry in ENTRIES:
        source = function_source(entry["function"])
        if source is None:
            stale.append(f"{entry['function']}: no such function")
        elif entry["removed"].strip() not in source:
            stale.append(f"{entry['function']}: {entry['removed']!r} is not in it")
    assert not stale, "\n".join(stale)


def test_a_stale_entry_is_found():
    assert function_source("diag.arithmetic.measures.x_match_rms") is not None
    assert function_source("diag.arithmetic.optim_step.xǁOptimizerStepǁdelta") is not None
    assert function_source("diag.arithmetic.optim_step.xǁAdamStepǁdelta") is None  # inherited, not its own
    assert function_source("diag.arithmetic.measures.x_no_such_function") is None
    assert function_source("diag.no_such_module.x_f") is None
