"""Results files, statistics and figures for the update diagnostic; never imports torch.

`analysis.store` reads and writes results files (combining seeds), `analysis.stats`
computes the seed-level intervals of the paper's Figure 4 and the finishing-phase
length, `analysis.grid` holds the collected file of an experiment grid and its statistics
(seed bands, terminal loss, Table 3), `analysis.sensitivity` tabulates the benefit over the diagnostic's
ablation settings, `analysis.figures` draws them (import it directly: it pulls in
matplotlib).
"""

from analysis.store import open_results, validate_results, write_dataset

__all__ = ["open_results", "validate_results", "write_dataset"]
