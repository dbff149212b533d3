"""The update diagnostic: compare one update computed at several depths.

    diag.compare_updates(model, optimizer, batch, eval_tokens, ...) -> xarray.Dataset

runs one (snapshot, batch) unit; `UpdateDiagnostic` shares the per-snapshot work
(clones of theta and the optimizer state, the NLL before the update) across batches
(`ShardedUpdateDiagnostic`: the same on an FSDP2-sharded model, docs/scaling.md); `diag.run.diagnose` runs
many snapshot files, or the `AdaptedModel` an adapter function returns, into one
results file; `diag.save_snapshot` writes a snapshot folder from any training loop that
`depthdiag diagnose` reads (`diag.load_snapshot_folder` loads one). See docs/diagnostic.md.

The names below load on first use: `import depthdiag.cli` (the `depthdiag` command)
must not pay for importing torch and xarray just to print its help.
"""

from importlib import import_module

_HOMES = {
    "AdaptedModel": "diag.adapter",
    "BiasCorrectionWarning": "diag.engine",
    "DepthMonitor": "diag.monitor",
    "DiagnosticOptions": "diag.engine",
    "ShardedUpdateDiagnostic": "diag.sharded",
    "UpdateDiagnostic": "diag.engine",
    "compare_updates": "diag.engine",
    "global_cosine": "diag.engine",
    "global_rms": "diag.engine",
    "match_rms": "diag.engine",
    "OptimizerStep": "diag.optim_step",
    "optimizer_step": "diag.optim_step",
    "load_snapshot_folder": "diag.snapshot_loading",
    "save_snapshot": "diag.snapshot_folder",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'diag' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
