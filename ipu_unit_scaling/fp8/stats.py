"""Per-cast FP8 statistics, collected only inside ``with fp8_stats() as stats:``.

Outside such a block nothing is computed, so casts cost nothing extra.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch

from .codec import decode
from .fp8_formats import FP8Format

__all__ = ["CastRecord", "Fp8Stats", "fp8_stats", "stats_enabled", "record_cast"]


@dataclass(frozen=True)
class CastRecord:
    """What one FP8 cast did.

    ``flushed``: nonzero finite inputs that became zero. ``saturated``: inputs whose scaled
    magnitude exceeded the format's max (infinities included), whatever the overflow policy
    then did with them. Fractions are of the nonzero inputs and of all inputs respectively.
    ``amax`` and ``rms`` are the input's, before scaling, over its finite values.
    ``sqnr_db`` is the cast's signal-to-quantisation-noise ratio, ``10 log10(sum x**2 /
    sum (x - q)**2)`` over the finite inputs (q the FP8 value): inf for an exact cast, nan for
    an all-zero input.
    """

    site: str
    format: str
    log2_scale: int
    numel: int
    nonzero: int
    flushed: int
    saturated: int
    amax: float = math.nan
    rms: float = math.nan
    sqnr_db: float = math.nan

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
        finite = torch.isfinite(scaled)
        nonzero_input = (scaled != 0) & finite
        zero_code = codes == 0
        if fmt.has_negative_zero:
            zero_code = zero_code | (codes == 0x80)
        zero = torch.zeros((), dtype=torch.float32)
        signal = torch.where(finite, scaled, zero)
        error = torch.where(finite, signal - decode(codes, fmt), zero)
        # One host read for every figure: a sync per figure would cost more than the figures.
        figures = torch.stack([figure.double() for figure in (
            nonzero_input.sum(), (nonzero_input & zero_code).sum(),
            (scaled.abs() > fmt.max).sum(), signal.abs().max() if signal.numel() else zero,
            signal.double().square().sum(), error.double().square().sum(), finite.sum(),
        )]).tolist()
    nonzero, flushed, saturated, amax, signal_energy, error_energy, finite_count = figures
    unscale = math.ldexp(1.0, -int(log2_scale))
    if signal_energy == 0:
        sqnr = math.nan
    elif math.isnan(error_energy):  # the "nan" overflow policy made a finite input NaN
        sqnr = -math.inf
    elif error_energy == 0:
        sqnr = math.inf
    else:
        sqnr = 10 * math.log10(signal_energy / error_energy)
    record = CastRecord(
        site=site or "<unnamed>",
        format=fmt.name,
        log2_scale=int(log2_scale),
        numel=scaled.numel(),
        nonzero=int(nonzero),
        flushed=int(flushed),
        saturated=int(saturated),
        amax=amax * unscale,
        rms=math.sqrt(signal_energy / finite_count) * unscale if finite_count else math.nan,
        sqnr_db=sqnr,
    )
    for stats in _active:
        stats.records.append(record)
