"""The update diagnostic: compare one update computed at several depths.

    diag.compare_updates(model, optimizer, batch, eval_tokens, ...) -> xarray.Dataset

runs one (snapshot, batch) unit; `UpdateDiagnostic` shares the per-snapshot work
(clones of theta and the optimizer state, the NLL before the update) across batches
(`ShardedUpdateDiagnostic`: the same on an FSDP2-sharded model, docs/scaling.md); `diag.driver.run.diagnose` runs
many snapshot files, or the `AdaptedModel` an adapter function returns, into one
results file; `diag.attribute_benefit` splits one unit's benefit over the training sequences
(to first order); `diag.save_snapshot` writes a snapshot folder from any training loop that
`depthdiag diagnose` reads (`diag.load_snapshot_folder` loads one). See docs/diagnostic.md.

The names below load on first use: `import depthdiag.cli` (the `depthdiag` command)
must not pay for importing torch and xarray just to print its help.
"""

from importlib import import_module

from common.moved import install

install(
    {
        "diag.adapter": "diag.sources.adapter",
        "diag.engine": "diag.arithmetic.engine",
        "diag.entries": "diag.sources.entries",
        "diag.evalset": "diag.sources.evalset",
        "diag.families": "diag.arithmetic.families",
        "diag.hf": "diag.sources.hf",
        "diag.hf_callbacks": "diag.in_training.hf_callbacks",
        "diag.hf_trainer": "diag.sources.hf_trainer",
        "diag.monitor": "diag.in_training.monitor",
        "diag.optim_step": "diag.arithmetic.optim_step",
        "diag.recommend": "diag.in_training.recommend",
        "diag.run": "diag.driver.run",
        "diag.sharded": "diag.arithmetic.sharded",
        "diag.snapshot_folder": "diag.sources.snapshot_folder",
        "diag.snapshot_loading": "diag.sources.snapshot_loading",
    }
)

_HOMES = {
    "AdaptedModel": "diag.sources.adapter",
    "BiasCorrectionWarning": "diag.arithmetic.model_checks",
    "DEPTHDIAG": "diag.arithmetic.families",
    "DepthMonitor": "diag.in_training.monitor",
    "HUGINN": "diag.arithmetic.families",
    "ModelFamily": "diag.arithmetic.families",
    "DiagnosticOptions": "diag.arithmetic.engine",
    "ShardedUpdateDiagnostic": "diag.arithmetic.sharded",
    "TargetGroups": "diag.arithmetic.target_groups",
    "UpdateDiagnostic": "diag.arithmetic.engine",
    "attribute_benefit": "diag.arithmetic.attribution",
    "compare_updates": "diag.arithmetic.engine",
    "global_cosine": "diag.arithmetic.measures",
    "global_rms": "diag.arithmetic.measures",
    "match_rms": "diag.arithmetic.measures",
    "OptimizerStep": "diag.arithmetic.optim_step",
    "optimizer_step": "diag.arithmetic.optim_step",
    "load_snapshot_folder": "diag.sources.snapshot_loading",
    "save_snapshot": "diag.sources.snapshot_folder",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'diag' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
