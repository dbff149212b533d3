"""The `depthdiag` group: its options, exit codes and the one-line reporting of the project's
failures that every command shares."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import click

from common.errors import EXIT_BAD_INPUT, EXIT_RUN_FAILED, InputError, RunFailed
from common.heap import keep_freed_memory
from common.signals import interrupt_exit, terminate_raises


def _os_error_line(err: OSError) -> str:
    """'PATH: reason' for an OS error, on one line (some libraries put several in theirs)."""
    reason = err.strerror or (os.strerror(err.errno) if err.errno else str(err).splitlines()[0])
    return f"{err.filename}: {reason}" if err.filename else reason


NOTHING_WRITTEN = "nothing was written (every output appears complete or not at all)"
"""What an interrupted command that writes its outputs only at the end kept."""


def reports_errors(command=None, *, kept: Callable[..., str] | None = None):
    """One line on stderr and the documented exit code for the project's failures:
    InputError and OS errors (a missing folder, no permission, a full disk) exit 2,
    RunFailed exits 3, an interrupt exits 130 (SIGINT) or 143 (SIGTERM) with a line saying
    what was kept: `kept(**the command's parameters)`, by default NOTHING_WRITTEN. Anything
    else is a bug and keeps its traceback (exit 1).

    Use as `@reports_errors` or `@reports_errors(kept=...)`."""
    if command is None:
        return functools.partial(reports_errors, kept=kept)

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as err:
            if _debug():
                raise
            name, code = interrupt_exit(err)
            click.echo(f"depthdiag: interrupted ({name}): {_what_was_kept(kept, kwargs)}", err=True)
            sys.exit(code)
        except (InputError, RunFailed, OSError) as err:
            if _debug():
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


def _what_was_kept(kept: Callable[..., str] | None, params: dict) -> str:
    if kept is None:
        return NOTHING_WRITTEN
    try:
        return kept(**params)
    except Exception:  # the interrupt is what matters; a kept line that cannot be made gives way
        return "the outputs written so far are kept"


def _debug() -> bool:
    return bool(click.get_current_context().find_root().params.get("debug"))


class OneLineErrors(click.Group):
    """A group whose usage errors (an unknown option, a missing argument, a bad value) are one
    line, "depthdiag: error: COMMAND: problem (see COMMAND --help)", with exit code 2 like every
    other bad input, instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as err:
            err.show()  # a bare `depthdiag` or `depthdiag grid`: the help, as click shows it
            sys.exit(err.exit_code)
        except click.ClickException as err:
            where = err.ctx.command_path if getattr(err, "ctx", None) is not None else (prog_name or "depthdiag")
            problem = " ".join(err.format_message().split())
            hint = f" (see {where} --help)" if isinstance(err, click.UsageError) else ""
            click.echo(f"depthdiag: error: {where}: {problem}{hint}", err=True)
            sys.exit(err.exit_code)
        except click.Abort as err:
            # An interrupt `reports_errors` let through (--debug) or that came while click itself
            # was working (parsing, before a command ran).
            interrupt = err.__cause__
            if not isinstance(interrupt, KeyboardInterrupt):
                raise
            if "--debug" in (sys.argv[1:] if args is None else list(args)):
                raise interrupt from None
            name, code = interrupt_exit(interrupt)
            click.echo(f"depthdiag: interrupted ({name}): {NOTHING_WRITTEN}", err=True)
            sys.exit(code)
        sys.exit(code if isinstance(code, int) else 0)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`--version`: the installed package's version, read from its metadata (no torch import)."""
    if not value or ctx.resilient_parsing:
        return
    from common.provenance import package_version

    click.echo(f"depthdiag {package_version()}")
    ctx.exit()


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
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
    good checkpoint); 130 interrupted by Ctrl-C (SIGINT), 143 stopped by SIGTERM
    (one line saying what was kept and how to resume; no temporaries left).
    --debug shows the traceback for 2, 3, 130 and 143 too.

    \b
    Every writer holds a lock on its output: a second writer is refused with the
    holder's pid. No command overwrites one of its inputs. An existing output is
    refused unless --force is given, and --force replaces only an output of the
    same kind that depthdiag wrote (a results file, a figure, a run directory...).
    """
    keep_freed_memory()  # a process-wide malloc setting, so the command sets it, not the library
    ctx = click.get_current_context()
    ctx.with_resource(terminate_raises())
