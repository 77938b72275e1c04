"""Per-cast FP8 statistics, collected only inside ``with fp8_stats() as stats:``.

Outside such a block nothing is computed, so casts cost nothing extra.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch

from .fp8_formats import FP8Format

__all__ = ["CastRecord", "Fp8Stats", "fp8_stats", "stats_enabled", "record_cast"]


@dataclass(frozen=True)
class CastRecord:
    """What one FP8 cast did.

    ``flushed``: nonzero finite inputs that became zero. ``saturated``: inputs whose scaled
    magnitude exceeded the format's max (infinities included), whatever the overflow policy
    then did with them. Fractions are of the nonzero inputs and of all inputs respectively.
    """

    site: str
    format: str
    log2_scale: int
    numel: int
    nonzero: int
    flushed: int
    saturated: int

    @property
    def flushed_fraction(self) -> float:
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def saturated_fraction(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0


@dataclass
class Fp8Stats:
    """The records of every cast made while collection was on, in call order."""

    records: List[CastRecord] = field(default_factory=list)

    def by_site(self) -> Dict[str, List[CastRecord]]:
        grouped: Dict[str, List[CastRecord]] = {}
        for record in self.records:
            grouped.setdefault(record.site, []).append(record)
        return grouped

    def select(self, suffix: str) -> List[CastRecord]:
        """Records whose site name ends with ``suffix`` (e.g. ``".grad_output"``)."""
        return [r for r in self.records if r.site.endswith(suffix)]

    @staticmethod
    def pooled_flushed_fraction(records: List[CastRecord]) -> float:
        nonzero = sum(r.nonzero for r in records)
        return sum(r.flushed for r in records) / nonzero if nonzero else 0.0


_active: List[Fp8Stats] = []


@contextmanager
def fp8_stats() -> Iterator[Fp8Stats]:
    """Collect a :class:`CastRecord` for every FP8 cast made inside the block."""
    stats = Fp8Stats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


def stats_enabled() -> bool:
    return bool(_active)


def record_cast(
    site: Optional[str],
    scaled: torch.Tensor,
    codes: torch.Tensor,
    fmt: FP8Format,
    log2_scale: int,
) -> None:
    """Record a cast of ``scaled`` (the input times 2**log2_scale, float32) to ``codes``."""
    if not _active:
        return
    with torch.no_grad():
        nonzero_input = (scaled != 0) & torch.isfinite(scaled)
        zero_code = codes == 0
        if fmt.has_negative_zero:
            zero_code = zero_code | (codes == 0x80)
        record = CastRecord(
            site=site or "<unnamed>",
            format=fmt.name,
            log2_scale=int(log2_scale),
            numel=scaled.numel(),
            nonzero=int(nonzero_input.sum().item()),
            flushed=int((nonzero_input & zero_code).sum().item()),
            saturated=int((scaled.abs() > fmt.max).sum().item()),
        )
    for stats in _active:
        stats.records.append(record)
