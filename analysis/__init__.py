"""Results files, statistics and figures for the update diagnostic; never imports torch.

`analysis.store` reads and writes results files, `analysis.stats` computes the
intervals of the paper's Figure 4, `analysis.figures` draws them (import it
directly: it pulls in matplotlib).
"""

from analysis.store import open_results, validate_results, write_dataset

__all__ = ["open_results", "validate_results", "write_dataset"]
