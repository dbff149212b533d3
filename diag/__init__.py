"""The update diagnostic: compare one update computed at several depths.

    diag.compare_updates(model, optimizer, batch, eval_tokens, ...) -> xarray.Dataset

runs one (snapshot, batch) unit; `UpdateDiagnostic` shares the per-snapshot work
(Delta(0), the NLL before the update) across batches; `diag.run.diagnose` runs
many snapshot files into one results file. See docs/diagnostic.md.
"""

from diag.engine import (DiagnosticOptions, UpdateDiagnostic, compare_updates, global_cosine, global_rms,
                         match_rms)
from diag.optim_step import OptimizerStep, optimizer_step

__all__ = ["DiagnosticOptions", "OptimizerStep", "UpdateDiagnostic", "compare_updates", "global_cosine",
           "global_rms", "match_rms", "optimizer_step"]
