"""The `depthdiag` command line: a table of commands, one module per command or group.

Each command parses options, builds a frozen config, and calls one library function; the work
lives in the libraries (trainer, diag, analysis, depthdiag.grid, depthdiag.downstream). The
command modules import only click and `common` at the top, so `depthdiag --help` loads neither
torch nor xarray.

Bad input (a missing or corrupt file, an invalid spec or config, an unwritable output, an
output in use by another depthdiag process) is reported as one line on stderr with exit code
2, a run that failed (diverged, ran out of disk) with exit code 3; `--debug` shows the
traceback. Every command that writes a file holds its lock (common/lock.py) and refuses an
existing one unless given `--force`.
"""

from depthdiag.cli import diagnose, exits, export, flops, grid, lm_eval, prepare, recommend, results, train
from depthdiag.cli.app import main

COMMANDS = (
    train.train_run,
    train.eval_checkpoint,
    exits.exits,
    diagnose.diagnose,
    diagnose.attribute,
    results.summarize,
    results.plot,
    results.sensitivity,
    results.machines,
    recommend.recommend,
    grid.grid,
    flops.flops,
    export.export_model,
    prepare.prepare,
    lm_eval.lm_eval_run,
)
"""Every command of `depthdiag`, in the order `--help` lists them."""

for command in COMMANDS:
    main.add_command(command)

__all__ = ["COMMANDS", "main"]
