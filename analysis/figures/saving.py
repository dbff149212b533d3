"""Writing a drawn figure to disk: the image and a PDF beside it, the two atomically together and
under the files' locks, the PDF without a creation date so the same results give the same bytes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure

from common.atomic import atomic_outputs
from common.errors import InputError
from common.lock import exclusive_output
from common.outputs import FIGURE, WRITTEN_BY, refuse_inputs, refuse_unrecognized


def figure_paths(out: str | os.PathLike) -> list[Path]:
    """The files `save_figure` writes for `out`: `out` and, unless it is a PDF, a PDF beside it.
    An unknown image format is refused here, before anything is written: the temporary
    file's name cannot tell matplotlib the format."""
    out = Path(out)
    if out.suffix.lstrip(".").lower() not in FigureCanvasBase.get_supported_filetypes():
        raise InputError(f"{out}: unknown image format {out.suffix or '(no extension)'}; use e.g. .png or .pdf")
    return [out] if out.suffix.lower() == ".pdf" else [out, out.with_suffix(".pdf")]


def _metadata(path: Path) -> dict | None:
    """depthdiag's mark, by which --force recognises the figure (common/outputs.py); no creation
    date in a PDF, so rerunning on the same results gives the same bytes."""
    kind = path.suffix.lstrip(".").lower()
    if kind == "pdf":
        return {"Creator": WRITTEN_BY, "CreationDate": None}
    if kind in ("png", "svg"):
        return {"Software" if kind == "png" else "Creator": WRITTEN_BY}
    return None


def save_figure(
    fig: Figure,
    out: str | os.PathLike,
    *,
    dpi: int = 200,
    force: bool = True,
    inputs: Iterable[str | os.PathLike] = (),
) -> list[Path]:
    """Write `fig` to `out` and a PDF beside it, holding both files' locks; the two appear
    together or not at all. Return the paths written. `check_figure`'s rule applies under the
    locks (InputError)."""
    paths = figure_paths(out)
    with contextlib.ExitStack() as locks:
        for path in paths:
            locks.enter_context(exclusive_output(path))
        check_figure(out, inputs=inputs, force=force)
        with atomic_outputs(paths) as temporaries:
            for path, tmp in zip(paths, temporaries):
                fig.savefig(tmp, format=path.suffix.lstrip(".").lower(), dpi=dpi, metadata=_metadata(path))
    return paths


def check_figure(out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (), force: bool) -> None:
    """The output rule (common/outputs.py) for the files `save_figure` writes for `out`: never
    one of `inputs`, only figures depthdiag drew, and an existing one only with `force`
    (`refuse_existing_figure`)."""
    paths = figure_paths(out)
    for path in paths:
        refuse_inputs(path, inputs)
    refuse_existing_figure(out, force=force)
    for path in paths:
        refuse_unrecognized(path, kind=FIGURE)


def refuse_existing_figure(out: str | os.PathLike, *, force: bool) -> None:
    """Unless `force`, refuse (InputError) a figure of which a file `save_figure` would write
    exists already, saying so when only part of the set is there: left by an interrupted
    earlier write, or the user's own file beside the image, so it is not overwritten unasked
    either; --force writes the whole set."""
    if force:
        return
    paths = figure_paths(out)
    present = [path for path in paths if path.exists()]
    missing = [path.name for path in paths if not path.exists()]
    if present and missing:
        raise InputError(
            f"{present[0]}: already exists without {', '.join(missing)} (an interrupted earlier write?); "
            "pass --force to overwrite it and write the whole figure"
        )
    if present:
        raise InputError(f"{present[0]}: already exists; pass --force to overwrite it")
