"""Scale analysis: per-tensor scale tracking, training-time reports, and scale plots.

`record_scales` records every tensor of one forward and backward pass; `ScaleReporter` writes a
per-role summary during training; `analyse` draws the plain and unit-scaled GPT side by side.
`plot`, `graph_to_dataframe` and `visualiser` are unit-scaling's, over a `track_scales` graph.
"""
from __future__ import annotations

from .report import ROLES, ScaleReporter, role_summary, worst_table
from .scale_figures import analyse, gpt_config_of, plot_scales
from .scale_graphs import example_batch, graph_to_dataframe, plot, visualiser
from .tracking import RangeFormat, ScaleRecord, cast_fractions, range_format, record_scales

__all__ = [
    "record_scales",
    "ScaleRecord",
    "RangeFormat",
    "range_format",
    "cast_fractions",
    "ScaleReporter",
    "role_summary",
    "worst_table",
    "ROLES",
    "plot_scales",
    "analyse",
    "gpt_config_of",
    # unit-scaling's analysis of a track_scales graph
    "graph_to_dataframe",
    "plot",
    "example_batch",
    "visualiser",
]
