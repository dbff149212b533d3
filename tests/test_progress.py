"""Progress output: plain lines off a terminal, a CLI that starts without torch."""

from __future__ import annotations

import io
import subprocess
import sys

from common.progress import LineProgress


def test_line_progress_prints_plain_lines_with_current_postfix():
    out = io.StringIO()
    bar = LineProgress(10, "train", "upd", every=0.0, file=out)
    for step in range(3):
        bar.set_postfix(depth=step + 1)
        bar.update(1)
    bar.close()  # nothing new since the last line: no repeat
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 3
    assert lines[-1].startswith("train: 3/10 upd (30%)") and lines[-1].endswith("depth=3")


def test_line_progress_is_occasional_and_ends_with_the_final_count():
    out = io.StringIO()
    bar = LineProgress(100, "diagnose", "unit", every=3600.0, file=out)
    for _ in range(100):
        bar.update(1)
    assert out.getvalue() == ""  # within the interval nothing is printed...
    bar.close()
    assert out.getvalue().startswith("diagnose: 100/100 unit (100%)")  # ...and the end always is


def test_cli_help_imports_neither_torch_nor_xarray():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import depthdiag.cli\n"
        "for args in (['--help'], ['train', '--help'], ['diagnose', '--help'], ['plot', '--help']):\n"
        "    assert CliRunner().invoke(depthdiag.cli.main, args).exit_code == 0, args\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'xarray', 'numpy'))\n"
        "print(heavy[:3])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
