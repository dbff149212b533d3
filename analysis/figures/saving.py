"""Writing a drawn figure to disk: the image and a PDF beside it, each atomically and under the
files' locks, the PDF without a creation date so the same results give the same bytes."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure

from common.atomic import atomic_output
from common.errors import InputError
from common.lock import claimed_outputs


def figure_paths(out: str | os.PathLike) -> list[Path]:
    """The files `save_figure` writes for `out`: `out` and, unless it is a PDF, a PDF beside it.
    An unknown image format is refused here, before anything is written: the temporary
    file's name cannot tell matplotlib the format."""
    out = Path(out)
    if out.suffix.lstrip(".").lower() not in FigureCanvasBase.get_supported_filetypes():
        raise InputError(f"{out}: unknown image format {out.suffix or '(no extension)'}; use e.g. .png or .pdf")
    return [out] if out.suffix.lower() == ".pdf" else [out, out.with_suffix(".pdf")]


def save_figure(fig: Figure, out: str | os.PathLike, *, dpi: int = 200, force: bool = True) -> list[Path]:
    """Write `fig` to `out` and a PDF beside it, each atomically, holding both files' locks;
    return the paths written. Without `force` an existing file is refused (InputError)."""
    paths = figure_paths(out)
    with claimed_outputs(paths, force=force):
        for path in paths:
            with atomic_output(path) as tmp:
                # No creation date in the PDF, so rerunning on the same results gives the same bytes.
                metadata = {"CreationDate": None} if path.suffix.lower() == ".pdf" else None
                fig.savefig(tmp, format=path.suffix.lstrip(".").lower(), dpi=dpi, metadata=metadata)
    return paths
