"""The mutation report of `make mutants` (docs/mutation-report.md), from mutmut's results in mutants/.

Every module of the numeric core ([tool.mutmut] only_mutate in pyproject.toml) gets a line: the
mutants mutmut made, those the tests killed (a timeout counts as killed: the mutant made a test
hang), those that survived, those no selected test reaches, and those shown equivalent. The
score is killed / (checked - equivalent), over the mutants the run reached. Every survivor
follows, one line each: its change, and either the reason it is equivalent
(tests/mutation/equivalent.toml) or its status, which makes it a mutant still to kill.

An equivalent mutant is named by its function and its change (the removed and the added line),
not by mutmut's number, which shifts when the function changes: an entry whose change no longer
occurs is reported as stale, so a reason never outlives the code it was written for. The same file
names, under [[killed_outside]], the few mutants a test kills that cannot run under mutmut (its
trampoline adds a stack frame); they count as killed, each with the test and why. Under
[[needs_device]] it names survivors that differ from the code only on a CUDA device (a tensor's
device, capturable or fused optimizer state): they stay survivors, with the reason, until a
machine with a GPU runs them.

Run from the repository root after `mutmut run`: python tests/mutation/report.py > REPORT.md
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from datetime import date
from importlib.metadata import version
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

EQUIVALENT = Path(__file__).with_name("equivalent.toml")
DETECTED = ("killed", "timeout")


@dataclass(frozen=True)
class Mutant:
    name: str
    """mutmut's name: module.x_function__mutmut_N (methods: module.xǁClassǁmethod__mutmut_N)."""
    status: str
    """mutmut's verdict: killed, timeout, survived, no tests, not checked, ..."""
    removed: str
    """The line the mutation changed, stripped (several joined by ' / ')."""
    added: str
    """What it became."""

    @property
    def function(self) -> str:
        return self.name.rpartition("__mutmut_")[0]

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.function, self.removed, self.added)


def changed_lines(diff: str) -> tuple[str, str]:
    body = [line for line in diff.splitlines() if not line.startswith(("---", "+++"))]
    removed = " / ".join(line[1:].strip() for line in body if line.startswith("-"))
    added = " / ".join(line[1:].strip() for line in body if line.startswith("+"))
    return removed, added


def mutants_of(path: str) -> list[Mutant]:
    meta = Path("mutants") / f"{path}.meta"
    if not meta.exists():
        sys.exit(f"{meta}: no mutmut results for {path}; run `make mutants` first")
    exit_codes = json.loads(meta.read_text())["exit_code_by_key"]
    mutants = []
    for name, code in sorted(exit_codes.items(), key=lambda item: _number_order(item[0])):
        status = status_by_exit_code[code]
        listed = status not in DETECTED and status != "not checked"
        removed, added = changed_lines(get_diff_for_mutant(name, path=path)) if listed else ("", "")
        mutants.append(Mutant(name, status, removed, added))
    return mutants


def _number_order(name: str) -> tuple[str, int]:
    function, _, number = name.rpartition("__mutmut_")
    return function, int(number)


def load_entries(kind: str) -> dict[tuple[str, str, str], dict]:
    """[[equivalent]] or [[killed_outside]] entries of tests/mutation/equivalent.toml, by key."""
    entries = tomllib.loads(EQUIVALENT.read_text()).get(kind, []) if EQUIVALENT.exists() else []
    return {(e["function"], e["removed"], e["added"]): e for e in entries}


def report(paths: list[str]) -> str:
    equivalent = {key: entry["why"] for key, entry in load_entries("equivalent").items()}
    killed_outside = load_entries("killed_outside")
    needs_device = {key: entry["why"] for key, entry in load_entries("needs_device").items()}
    used: set[tuple[str, str, str]] = set()
    unchecked_functions: set[str] = set()
    rows, details = [], []
    for path in paths:
        mutants = mutants_of(path)
        unchecked_functions.update(m.function for m in mutants if m.status == "not checked")
        checked = [m for m in mutants if m.status != "not checked"]
        counts = Counter(m.status for m in checked)
        undetected = [m for m in checked if m.status not in DETECTED]
        shown = [m for m in undetected if m.status == "survived" and m.key in equivalent]
        outside = [m for m in undetected if m.status == "survived" and m.key in killed_outside]
        used.update(m.key for m in shown + outside)
        used.update(m.key for m in undetected if m.status == "survived" and m.key in needs_device)
        killed = counts["killed"] + counts["timeout"] + len(outside)
        score = killed / (len(checked) - len(shown)) if len(checked) > len(shown) else math.nan
        other = len(undetected) - counts["survived"] - counts["no tests"]
        survived = counts["survived"] - len(shown) - len(outside)
        rows.append(
            f"| `{path}` | {len(mutants)} | {len(checked)} | {killed} | {survived} "
            f"| {counts['no tests']} | {len(shown)} | {other} | {score:.1%} |"
        )
        if undetected:
            details.append(f"\n### `{path}`\n")
            for m in undetected:
                verdict = f"**{m.status}**"
                if m.status == "survived" and m.key in equivalent:
                    verdict = f"equivalent: {equivalent[m.key]}"
                elif m.status == "survived" and m.key in killed_outside:
                    entry = killed_outside[m.key]
                    verdict = f"killed outside mutmut by `{entry['test']}`: {entry['why']}"
                elif m.status == "survived" and m.key in needs_device:
                    verdict = f"**survived**, needs a CUDA device: {needs_device[m.key]}"
                details.append(f"- `{m.name.rpartition('.')[2]}` `{m.removed}` -> `{m.added}`: {verdict}")
    # An entry for a function with mutants still unchecked may yet match one of them.
    listed = (*equivalent, *killed_outside, *needs_device)
    stale = [key for key in listed if key not in used and key[0] not in unchecked_functions]
    lines = [
        "| module | mutants | checked | killed | survived | no tests | equivalent | other | score |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        *details,
    ]
    if stale:
        lines += ["\n### Stale equivalence entries (their change no longer survives)\n"]
        lines += [f"- `{function}` `{removed}` -> `{added}`" for function, removed, added in stale]
    return "\n".join(lines) + "\n"


def header(config: dict) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tests = ", ".join(f"`{Path(t).name}`" for t in config["pytest_add_cli_args_test_selection"])
    return f"""# Mutation report

mutmut {version("mutmut")}'s results in mutants/ for the code of commit {commit or "(no git)"},
{date.today().isoformat()}. mutmut keeps a verdict while its function's code is unchanged (a hash per
function), so a run resumed or rerun after a change checks only the functions that changed.

mutmut makes one small change at a time (an operator, a number, a comparison, an argument dropped)
in every function of the numeric core and runs the selected tests that reach that function against
each change. A mutant is *killed* when a test fails (or hangs: a timeout), *survived* when every
test passes, *no tests* when no selected test reaches its function, *not checked* when the run
stopped before it. The score is killed / (checked - equivalent), where checked counts every
mutant the run reached ("no tests" included, as not killed); an equivalent mutant computes the
same results as the code for every input it can receive (the reason stands beside it below, from
`tests/mutation/equivalent.toml`). A mutant *killed outside mutmut* is killed by a test that
cannot run under mutmut (it is deselected there; the test and the reason stand beside it) and
counts as killed. A survivor that *needs a CUDA device* differs from the code only there (the
reason beside it); it stays a survivor. Input checks' `raise InputError(...)` statements are not
mutated (their conditions are): a message is not a number we publish.

Tests run against the mutants: {tests}.
"""


def main() -> None:
    config = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["mutmut"]
    sys.stdout.write(header(config) + "\n" + report(config["only_mutate"]))


if __name__ == "__main__":
    main()
