"""Summaries of scale records: per-role statistics, the worst tensors, a training-time CSV."""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from torch import Tensor, nn

from ..training.run_directory import error_naming
from .tracking import ScaleRecord, record_scales

__all__ = ["ROLES", "role_summary", "worst_table", "ScaleReporter"]

ROLES = ("activation", "weight", "gradient")


def role_summary(
    records: Sequence[ScaleRecord], formats: Sequence[str]
) -> Dict[str, Dict[str, float]]:
    """Per role: min/max log2 std and, per format, the element-weighted fractions that would
    underflow and overflow (`underflow_F143`, `overflow_F143`, ...)."""
    summary: Dict[str, Dict[str, float]] = {}
    for role in ROLES:
        chosen = [r for r in records if r.role == role and r.std > 0]
        if not chosen:
            continue
        elements = sum(r.numel for r in chosen)
        row = {
            "min_log2_std": min(r.log2_std for r in chosen),
            "max_log2_std": max(r.log2_std for r in chosen),
        }
        for fmt in formats:
            row[f"underflow_{fmt}"] = sum(r.underflow[fmt] * r.numel for r in chosen) / elements
            row[f"overflow_{fmt}"] = sum(r.overflow[fmt] * r.numel for r in chosen) / elements
        summary[role] = row
    return summary


def _distance_from_unit(record: ScaleRecord) -> float:
    return abs(record.log2_std) if record.std > 0 else math.inf


def worst_table(
    records_by_model: Dict[str, Sequence[ScaleRecord]],
    formats: Sequence[str] = ("F143", "F152", "FP16"),
    count: int = 10,
) -> str:
    """A text table of each model's `count` tensors furthest from unit std (in log2).

    Constant tensors (std 0, such as a LayerNorm's initial weight) are left out: their scale is
    set by their value, not their spread.
    """
    worst = {
        model_name: sorted((r for r in records if r.std > 0), key=_distance_from_unit,
                           reverse=True)[:count]
        for model_name, records in records_by_model.items()
    }
    # As wide as the longest op name: a name cut short could lose which layer it is.
    width = max([34] + [len(r.op) for shown in worst.values() for r in shown])
    header = f"{'model':<12} {'op':<{width}} {'role':<10} {'log2 std':>8} {'absmax':>9}"
    header += "".join(f" {'under ' + f:>11}" for f in formats)
    lines = [header, "-" * len(header)]
    for model_name, shown in worst.items():
        for record in shown:
            line = (
                f"{model_name:<12} {record.op:<{width}} {record.role:<10} "
                f"{record.log2_std:>8.2f} {record.absmax:>9.3g}"
            )
            line += "".join(f" {record.underflow[f]:>11.1%}" for f in formats)
            lines.append(line)
    return "\n".join(lines)


class ScaleReporter:
    """Appends per-role scale statistics to `run_dir/scale_report.csv` every `every` steps.

    `maybe_record(step, model, input_ids, labels)` returns at once on other steps. On a
    reporting step it runs one extra forward and backward pass (`record_scales`, which leaves
    the model's `.grad` alone) and writes one row per role: `step, role, min_log2_std,
    max_log2_std`, then `underflow_<fmt>, overflow_<fmt>` for each format.
    """

    def __init__(
        self, run_dir: Union[str, Path], every: int, formats: Sequence[str] = ("F143", "F152")
    ) -> None:
        if every < 1:
            raise ValueError(f"every={every!r} must be at least 1")
        self.path = Path(run_dir) / "scale_report.csv"
        self.every = every
        self.formats = tuple(formats)
        self.columns: List[str] = ["step", "role", "min_log2_std", "max_log2_std"]
        for fmt in self.formats:
            self.columns += [f"underflow_{fmt}", f"overflow_{fmt}"]

    def is_reporting_step(self, step: int) -> bool:
        return step % self.every == 0

    def maybe_record(
        self, step: int, model: nn.Module, input_ids: Tensor, labels: Optional[Tensor]
    ) -> None:
        if not self.is_reporting_step(step):
            return
        records = record_scales(model, input_ids, labels, formats=self.formats)
        summary = role_summary(records, self.formats)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            new_file = not self.path.exists()
            with self.path.open("a", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=self.columns)
                if new_file:
                    writer.writeheader()
                for role, row in summary.items():
                    writer.writerow({"step": step, "role": role, **row})
        except OSError as error:  # a full disk, say: the message names the file
            raise error_naming(self.path, error) from None
