"""The application layer: the `depthdiag` command line (depthdiag/cli/), experiment grids
(depthdiag/grid.py sizes their cells, depthdiag/grid_run.py runs them), lm-eval and downstream workflows
(depthdiag/downstream.py) and training curves (depthdiag/curves.py). It may import every
other package; none of them imports it."""
