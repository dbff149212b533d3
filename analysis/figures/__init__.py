"""Figures of the update diagnostic and of experiment grids, one module per figure family:

- `benefit`: the paper's Figure 4 (the benefit by serving depth and depth-averaged per snapshot);
- `update_depth_map`: the update-depth x serving-depth map;
- `monitor`: the in-training monitor's figure (RUN/monitor.h5);
- `grid`: the grid figures 1, 2, 3-top, 5 and 8 (from `analysis.grid`'s seed bands);
- `curves`: one run's training curves (RUN/metrics.jsonl, `analysis.training`);
- `exits`: exit criteria against the oracle and the fixed depths (a `depthdiag exits` file);
- `attribution`: how well the attribution finds planted training sequences (AUROC per seed);
- `downstream`: downstream evaluation, Figure 3's bottom row (`analysis.downstream`'s bands);
- `saving`: writing a figure (`save_figure`), apart from drawing it;
- `shared`: the style, palette and helpers more than one family draws with.

Computing and drawing are separate: `analysis.stats` (and its siblings) produce interval Datasets
(mean, lower, upper, n), and the functions here draw exactly those numbers, never
an interval of their own (so no seaborn estimator or bootstrap is used; seaborn
only provides the style and palette). Figures are built on `matplotlib.figure.Figure`
rather than pyplot, so nothing needs a display and no global figure state is kept.

Every plot function takes its data and `ax=None` and returns the axes it drew on; each
`figure*` function returns a Figure. They are re-exported here, so `from analysis.figures
import X` is the one import for any of them.
"""

from analysis.figures.attribution import auroc_figure, plot_auroc
from analysis.figures.benefit import figure4, plot_benefit_by_depth, plot_depth_averaged_benefit
from analysis.figures.curves import curves_figure, plot_training_loss, plot_validation_nll, smoothing_window
from analysis.figures.downstream import figure3_downstream, plot_downstream_accuracy
from analysis.figures.exits import exits_figure, plot_exits
from analysis.figures.grid import (
    figure1,
    figure2,
    figure3_loss,
    figure5,
    figure8,
    plot_flops_vs_nll,
    plot_loss_curves,
    plot_nll_by_depth,
    plot_nll_difference,
    plot_normalised_recall,
    plot_recall_by_depth,
    plot_schedule_bands,
)
from analysis.figures.groups import group_benefit_figure, plot_group_benefit
from analysis.figures.monitor import monitor_figure, plot_monitor_heatmap, plot_monitor_trend
from analysis.figures.saving import check_figure, figure_paths, save_figure
from analysis.figures.update_depth_map import plot_update_depth_map, update_depth_map_figure

__all__ = [
    "auroc_figure",
    "group_benefit_figure",
    "plot_group_benefit",
    "check_figure",
    "curves_figure",
    "figure1",
    "figure2",
    "figure3_downstream",
    "figure3_loss",
    "figure4",
    "figure5",
    "figure8",
    "exits_figure",
    "figure_paths",
    "monitor_figure",
    "plot_auroc",
    "plot_benefit_by_depth",
    "plot_exits",
    "plot_depth_averaged_benefit",
    "plot_downstream_accuracy",
    "plot_flops_vs_nll",
    "plot_loss_curves",
    "plot_monitor_heatmap",
    "plot_monitor_trend",
    "plot_nll_by_depth",
    "plot_nll_difference",
    "plot_normalised_recall",
    "plot_recall_by_depth",
    "plot_schedule_bands",
    "plot_training_loss",
    "plot_update_depth_map",
    "plot_validation_nll",
    "save_figure",
    "smoothing_window",
    "update_depth_map_figure",
]
