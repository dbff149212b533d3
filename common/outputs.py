"""The rule every writer follows before it writes an output, in one place:

- no command deletes or overwrites a file it was given as input: an output that is one of
  the inputs (by real identity: symlinks and other spellings resolved), or a folder output
  that holds one, is refused;
- an existing output is refused unless the command was given `--force`;
- `--force` replaces only an output of the same kind that depthdiag itself wrote (a results
  file, a figure, a run directory, ...), recognised by what depthdiag puts in it; anything
  else is refused even with `--force`, so a typo in `--out` cannot replace a stranger's file.

An existing empty folder counts as absent for a folder output. Refusals are InputErrors
(exit 2) naming the file. `common.lock.claimed_outputs` applies the rule again under the
outputs' locks, so a check before long work and the write itself agree.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from common.atomic import interrupts_deferred, is_temporary_of, temporary_suffix
from common.errors import InputError

WRITTEN_BY = "depthdiag"
"""The mark depthdiag leaves in the outputs it writes (a results file's `written_by`
attribute, analysis/store.py; a figure's Software/Creator metadata), by which `--force`
recognises them."""

_FIGURE_BYTES_READ = 64 * 2**20
_CSV_COLUMNS = {"mean", "lower", "upper", "n"}
"""Columns every summary table has (analysis.stats.summary_table, monitor_summary_table)."""
GRID_SPEC_HEADER = "# Written by depthdiag recommend"


@dataclass(frozen=True)
class OutputKind:
    """A kind of output depthdiag writes, and how to recognise one it wrote."""

    noun: str
    """What the output is, for messages: "results file", "run directory"."""
    recognizes: Callable[[Path], bool]
    """Whether an existing path is an output of this kind that depthdiag wrote."""
    folder: bool = False
    """A folder output (an existing empty folder counts as absent)."""
    existing_hint: str = "pass --force to overwrite it"
    """What a refused existing output can do, for the message."""
    entries: tuple[str, ...] = ()
    """For a folder output: every name depthdiag writes in it (named in a refusal of the others)."""


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(path)


def _is_same_or_inside(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _same_file(a: Path, b: Path) -> bool:
    """By real path, and by inode for hard links."""
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _exists(path: Path, folder: bool) -> bool:
    """Whether `path` is there to be replaced: a dangling symlink counts, an empty folder
    does not for a folder output."""
    if not os.path.lexists(path):
        return False
    if folder and path.is_dir():
        return any(path.iterdir())
    return True


def refuse_inputs(output: str | os.PathLike, inputs: Iterable[str | os.PathLike], *, folder: bool = False) -> None:
    """Refuse (InputError) an `output` that is one of `inputs`, or, for a `folder` output, holds one."""
    output = Path(output)
    real_output = _real(output)
    for given in inputs:
        given = Path(given)
        if _same_file(output, given):
            raise InputError(f"{output}: is an input of this command ({given}); write the output elsewhere")
        if folder and _is_same_or_inside(_real(given), real_output):
            raise InputError(f"{output}: holds an input of this command ({given}); write the output elsewhere")


def refuse_unrecognized(output: str | os.PathLike, *, kind: OutputKind) -> None:
    """Refuse (InputError) an existing `output` that is not a `kind` depthdiag wrote: what
    `--force` may not replace."""
    output = Path(output)
    if not _exists(output, kind.folder):
        return
    if kind.folder and not output.is_dir():
        raise InputError(f"{output}: exists and is not a folder; the output is a {kind.noun}, a folder")
    if not kind.folder and output.is_dir():
        raise InputError(f"{output}: is a folder; the output is a {kind.noun}, a file")
    if kind.recognizes(output):
        return
    others = _unexpected_entries(output, kind.entries) if kind.folder and kind.entries else []
    why = f"holds files depthdiag does not write there ({', '.join(others[:3])})" if others else None
    raise InputError(
        f"{output}: {why or f'exists and is not a {kind.noun} depthdiag wrote'}; --force replaces only "
        f"a {kind.noun} depthdiag wrote, so remove it yourself or choose another output"
    )


def check_output(
    output: str | os.PathLike, *, kind: OutputKind, inputs: Iterable[str | os.PathLike] = (), force: bool
) -> None:
    """Apply the module's rule to one output about to be written; raise InputError naming it."""
    output = Path(output)
    refuse_inputs(output, inputs, folder=kind.folder)
    if _exists(output, kind.folder) and not force:
        if kind.folder != output.is_dir():
            refuse_unrecognized(output, kind=kind)  # the wrong type of file: --force would not help
        raise InputError(f"{output}: already exists; {kind.existing_hint}")
    refuse_unrecognized(output, kind=kind)


def check_outputs(
    outputs: Iterable[str | os.PathLike], *, kind: OutputKind, inputs: Iterable[str | os.PathLike] = (), force: bool
) -> None:
    """`check_output` for each of `outputs`, all of one kind (the members of a set)."""
    inputs = list(inputs)
    for output in outputs:
        check_output(output, kind=kind, inputs=inputs, force=force)


# --- recognising depthdiag's outputs ------------------------------------------------------------


_FIGURE_MARKS = {
    ".png": b"tEXtSoftware\x00" + WRITTEN_BY.encode(),
    ".pdf": b"/Creator (" + WRITTEN_BY.encode() + b")",
    ".svg": b"<dc:title>" + WRITTEN_BY.encode() + b"</dc:title>",
}
"""How the mark reads in each format's metadata as matplotlib writes it (the PNG text chunk's
keyword and value, the PDF info dictionary's entry, the SVG creator's name)."""


def _has_mark(path: Path) -> bool:
    mark = _FIGURE_MARKS.get(path.suffix.lower())
    try:
        with open(path, "rb") as handle:
            return mark is not None and mark in handle.read(_FIGURE_BYTES_READ)
    except OSError:
        return False


def _is_figure(path: Path) -> bool:
    """A figure file carrying depthdiag's mark in its metadata; an image format without
    metadata (JPEG) is recognised by the marked PDF written beside it."""
    if not path.is_file():
        return False
    if path.suffix.lower() in _FIGURE_MARKS:
        return _has_mark(path)
    return _has_mark(path.with_suffix(".pdf"))


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline()
    except (OSError, UnicodeDecodeError):
        return ""


def _is_summary_csv(path: Path) -> bool:
    return path.is_file() and _CSV_COLUMNS <= set(_first_line(path).strip().split(","))


def _is_grid_spec(path: Path) -> bool:
    return path.is_file() and _first_line(path).startswith(GRID_SPEC_HEADER)


def json_file(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _unexpected_entries(folder: Path, names: Iterable[str]) -> list[str]:
    """The entries of `folder` other than `names`, their locks and the temporaries interrupted
    writes of them left, sorted. Any other hidden file (a `.git`, a `.env`) is unexpected: a
    folder holding one is not depthdiag's to replace."""
    allowed = set(names)

    def own(name: str) -> bool:
        return (
            name in allowed
            or (name.startswith(".") and name.endswith(".lock") and name[1:-5] in allowed)
            or any(is_temporary_of(name, target) for target in allowed)
        )

    return sorted(entry.name for entry in folder.iterdir() if not own(entry.name))


def only_entries(folder: Path, names: Iterable[str]) -> bool:
    """Whether `folder` holds nothing but entries named in `names`, their locks and temporaries."""
    try:
        return not _unexpected_entries(folder, names)
    except OSError:
        return False


FIGURE = OutputKind("figure", _is_figure)
SUMMARY_CSV = OutputKind("summary table (CSV)", _is_summary_csv)
GRID_SPEC = OutputKind("grid spec", _is_grid_spec)


def empty_folder(folder: str | os.PathLike) -> None:
    """Delete everything in `folder` (an output `--force` replaces), keeping the folder itself
    (it may be a symlink to where the user wants the run). The entries are first moved into
    a temporary folder beside it, one rename each, then deleted; only `kill -9` can stop it
    half-way, leaving each entry in place or in a temporary that the next holder of the
    output's lock removes."""
    folder = Path(os.path.realpath(folder))
    if not folder.is_dir():
        return
    # Interrupts wait until it is done: a folder half emptied would be neither the old output
    # nor a fresh start, and a trash folder left behind would break the promise of no temporaries.
    with interrupts_deferred():
        trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=temporary_suffix(folder), dir=folder.parent))
        for entry in list(folder.iterdir()):
            os.replace(entry, trash / entry.name)
        shutil.rmtree(trash)
