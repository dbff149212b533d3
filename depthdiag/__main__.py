"""`python -m depthdiag`: the command line, e.g. under
`torchrun --nproc_per_node=N -m depthdiag train CONFIG`, which runs it on every rank."""

from depthdiag.cli import main

main(prog_name="depthdiag")
