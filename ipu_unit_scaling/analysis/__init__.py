"""Scale analysis: per-tensor scale tracking, training-time reports, and scale plots."""
from __future__ import annotations

from .tracking import RangeFormat, ScaleRecord, cast_fractions, range_format, track_scales

__all__ = ["track_scales", "ScaleRecord", "RangeFormat", "range_format", "cast_fractions"]
