"""Scale analysis: per-tensor scale tracking, training-time reports, and scale plots.

`record_scales` records every tensor of one forward and backward pass; `ScaleReporter` writes a
per-role summary during training; `analyse` draws the plain and unit-scaled GPT side by side.
"""
from __future__ import annotations

from .plot import analyse, gpt_config_of, plot_scales
from .report import ROLES, ScaleReporter, role_summary, worst_table
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
]
