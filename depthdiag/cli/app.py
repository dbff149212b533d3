"""The `depthdiag` group: its options, exit codes and the one-line reporting of the project's
failures that every command shares."""

from __future__ import annotations

import functools
import os
import sys

import click

from common.errors import EXIT_BAD_INPUT, EXIT_RUN_FAILED, InputError, RunFailed
from common.heap import keep_freed_memory


def _os_error_line(err: OSError) -> str:
    """'PATH: reason' for an OS error, on one line (some libraries put several in theirs)."""
    reason = err.strerror or (os.strerror(err.errno) if err.errno else str(err).splitlines()[0])
    return f"{err.filename}: {reason}" if err.filename else reason


def reports_errors(command):
    """One line on stderr and the documented exit code for the project's failures:
    InputError and OS errors (a missing folder, no permission, a full disk) exit 2,
    RunFailed exits 3. Anything else is a bug and keeps its traceback (exit 1)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (InputError, RunFailed, OSError) as err:
            if click.get_current_context().find_root().params.get("debug"):
                raise
            if isinstance(err, RunFailed):
                message, code = str(err), EXIT_RUN_FAILED
            elif isinstance(err, InputError):
                message, code = str(err), EXIT_BAD_INPUT
            else:
                message, code = _os_error_line(err), EXIT_BAD_INPUT
            click.echo(f"depthdiag: error: {message}", err=True)
            sys.exit(code)

    return wrapper


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`--version`: the installed package's version, read from its metadata (no torch import)."""
    if not value or ctx.resilient_parsing:
        return
    from common.provenance import package_version

    click.echo(f"depthdiag {package_version()}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the depthdiag version and exit.",
)
def main(debug: bool) -> None:
    """Train adaptive-depth looped transformers and diagnose when multi-depth updates matter.

    \b
    Typical pipeline:
      depthdiag train configs/tiny.toml --out runs/tiny
      depthdiag diagnose runs/tiny/snapshots/*.pt --out results/tiny.h5
      depthdiag summarize results/tiny.h5
      depthdiag plot results/tiny.h5 --figure 4 --out figures/figure4.png

    \b
    Exit codes: 0 success; 1 a bug (traceback); 2 bad input (one line naming
    the file and the problem, nothing half-written); 3 the run failed
    (divergence, disk full during a run: one line naming the step and the last
    good checkpoint). --debug shows the traceback for 2 and 3 too.

    \b
    Every writer holds a lock on its output: a second writer is refused with the
    holder's pid. An existing output is refused unless --force is given.
    """
    keep_freed_memory()  # a process-wide malloc setting, so the command sets it, not the library
