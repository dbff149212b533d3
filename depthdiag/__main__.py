"""`python -m depthdiag`: the command line, e.g. under
`torchrun --nproc_per_node=N -m depthdiag train CONFIG`, which runs it on every rank."""

import os
import sys

from depthdiag.cli import main

try:
    main(prog_name="depthdiag")
except SystemExit as finished:
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        raise
    # A rank of torchrun ends without the interpreter's finalization, once the command has written
    # its outputs, closed its files and left the process group: a gloo group that DDP or FSDP2 used
    # stays held from C++ after destroy_process_group, and its threads, torn down during
    # finalization, abort the rank at random ("terminate called without an active exception").
    code = finished.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
