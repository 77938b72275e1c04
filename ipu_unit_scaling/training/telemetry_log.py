"""``telemetry.csv``: what a run's telemetry recorded, one row per (step, site), as data.

Rows are appended whole with one ``write`` call each, like ``metrics.csv``, so a killed run
leaves every row it finished; a resumed run first drops the rows after its checkpoint's step
(:func:`ipu_unit_scaling.training.run_records.keep_report_rows_up_to`), then records those
steps again, so no step is logged twice. Open it with ``pandas.read_csv`` or the csv module.

Each row has a ``kind``:

- ``cast``: one FP8 cast site (or, in a run without FP8, what a static cast of a linear layer's
  input, weight or output gradient would do). ``role`` is activation, weight or gradient;
  ``format``, ``log2_scale`` (the scaling bias), ``amax`` and ``rms`` of the unscaled tensor,
  ``flushed_fraction`` (nonzero values that became zero), ``saturated_fraction`` and
  ``sqnr_db`` (signal-to-quantisation-noise ratio of the cast).
- ``param``: one parameter. ``role`` is its u-μP type; ``weight_rms`` after the step,
  ``grad_rms``, ``update_rms`` and ``update_ratio`` (update RMS over the weight RMS before the
  step), ``learning_rate`` (its group's rate at that step).
- ``attention``: one attention layer; ``amax`` is its largest attention logit.
- ``loss``: the training loss, at every step (site ``loss``).
- ``warning``: an early warning (:mod:`ipu_unit_scaling.training.run_health`); ``role`` is its
  kind, ``note`` the line the training log printed.
"""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .run_directory import RunError, os_error_reason, read_regular_file
from .run_records import MetricsLog

__all__ = ["TELEMETRY_FIELDS", "TelemetryLog", "TelemetryFileError",
           "read_telemetry", "cut_short_row", "format_value"]

TELEMETRY_FIELDS = (
    "step", "kind", "site", "role", "format", "log2_scale", "amax", "rms", "flushed_fraction",
    "saturated_fraction", "sqnr_db", "weight_rms", "grad_rms", "update_rms", "update_ratio",
    "learning_rate", "note",
)
NUMERIC_FIELDS = tuple(name for name in TELEMETRY_FIELDS
                       if name not in ("step", "kind", "site", "role", "format", "note"))
KINDS = ("cast", "param", "attention", "loss", "warning")


class TelemetryFileError(RunError):
    """A telemetry file that is missing, damaged or not this package's."""


def format_value(value: Any) -> str:
    """A cell: floats with 7 significant digits (float32 telemetry needs no more), ints as
    they are, None as empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else f"{value:.7g}"
    return str(value)


class TelemetryLog(MetricsLog):
    """``telemetry.csv`` of one run: :class:`~.run_records.MetricsLog`'s appending of whole
    rows, with the telemetry's columns and number formats. ``path`` None writes nothing (a
    distributed run's ranks other than 0)."""

    def __init__(self, path: Optional[Path], fresh: bool) -> None:
        self._fd = -1
        if path is None:
            return
        # (a run resumed from a version without telemetry starts the file)
        super().__init__(path, fresh or not os.path.exists(path), TELEMETRY_FIELDS)

    def write(self, rows: Sequence[Dict[str, Any]]) -> None:  # type: ignore[override]
        if self._fd < 0:
            return
        # One write per row: a kill leaves whole rows and at most one cut short, which the
        # reader drops.
        for row in rows:
            super().write({name: format_value(row.get(name)) for name in TELEMETRY_FIELDS})

    def sync(self) -> None:
        if self._fd >= 0:
            super().sync()


def read_telemetry(path: Path) -> List[Dict[str, Any]]:
    """The rows of a telemetry file, numbers as floats (NaN where empty) and ``step`` an int.

    A last row cut short by a kill is dropped. TelemetryFileError (one line) for a file that
    is missing, unreadable, not a telemetry file, or damaged (naming the first bad line).
    """
    path = Path(path)
    try:
        text = read_regular_file(path).decode("utf-8")
    except FileNotFoundError:
        raise TelemetryFileError(f"{path} does not exist") from None
    except UnicodeDecodeError:
        raise TelemetryFileError(f"{path} is damaged: it is not UTF-8 text") from None
    except OSError as error:
        raise TelemetryFileError(f"cannot read {path}: {os_error_reason(error)}") from None
    lines = text.split("\n")
    if lines[0] != ",".join(TELEMETRY_FIELDS):
        raise TelemetryFileError(f"{path} is not a telemetry file of this package (its header "
                                 "differs)")
    complete = lines[1:-1]  # the last piece has no newline after it: empty, or cut short
    rows: List[Dict[str, Any]] = []
    for number, cells in enumerate(csv.reader(complete), start=2):
        if len(cells) != len(TELEMETRY_FIELDS):
            raise TelemetryFileError(f"{path} is damaged at line {number}: "
                                     f"{len(cells)} cells, not {len(TELEMETRY_FIELDS)}")
        row: Dict[str, Any] = dict(zip(TELEMETRY_FIELDS, cells))
        try:
            row["step"] = int(row["step"])
            for name in NUMERIC_FIELDS:
                row[name] = float(row[name]) if row[name] else math.nan
        except ValueError:
            raise TelemetryFileError(f"{path} is damaged at line {number}: a number that "
                                     "does not read as one") from None
        if row["kind"] not in KINDS:
            raise TelemetryFileError(f"{path} is damaged at line {number}: unknown kind "
                                     f"{row['kind']!r}")
        rows.append(row)
    return rows


def cut_short_row(path: Path) -> Optional[str]:
    """The last row of a telemetry file when it was cut short (no newline after it: a kill
    while writing, or a damaged copy), which :func:`read_telemetry` drops; else None."""
    try:
        text = read_regular_file(Path(path))
    except OSError:
        return None
    if not text or text.endswith(b"\n"):
        return None
    return text.rsplit(b"\n", 1)[-1].decode("utf-8", "replace")
