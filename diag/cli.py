"""The `depthdiag` command line. Each command parses options, builds a frozen
config, and calls one library function; the work lives in the libraries.

Bad input (a missing or corrupt file, an invalid spec or config) is reported
as one line on stderr with exit code 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import functools
import sys

import click

from trainer.errors import InputError


class Context:
    debug: bool = False


def reports_input_errors(command):
    """Turn InputError (and ValueError from config validation) into a one-line message and exit 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (InputError, ValueError) as err:
            if Context.debug:
                raise
            click.echo(f"depthdiag: error: {err}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def main(debug: bool) -> None:
    """Train adaptive-depth looped transformers and diagnose when multi-depth updates matter.

    \b
    Typical pipeline:
      depthdiag train configs/tiny.toml --out runs/tiny
      depthdiag diagnose runs/tiny/snapshots/*.pt --out results/tiny.h5
      depthdiag summarize results/tiny.h5
      depthdiag plot results/tiny.h5 --figure 4 --out figures/figure4.png
    """
    Context.debug = debug


# --- flops ----------------------------------------------------------------------------------

# --- train / eval ---------------------------------------------------------------------------

# --- diagnose -------------------------------------------------------------------------------

# --- summarize / plot -----------------------------------------------------------------------


if __name__ == "__main__":
    main()
