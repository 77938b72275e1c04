"""Per-cast FP8 statistics, collected only inside ``with fp8_stats() as stats:``.

Outside such a block nothing is computed, so casts cost nothing extra.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .codec import decode
from .fp8_formats import FP8Format

__all__ = ["CastRecord", "Fp8Stats", "fp8_stats", "stats_enabled", "record_cast",
           "record_values", "recorded_only_by"]


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
        # By identity: two collections with the same records are equal, and a block may sit
        # inside another (a run's telemetry inside a user's fp8_stats).
        _active[:] = [other for other in _active if other is not stats]


@contextmanager
def recorded_only_by(stats: Fp8Stats) -> Iterator[None]:
    """Inside the block, casts are recorded by ``stats`` alone, not by the other active
    collections: for casts made only to be measured (run telemetry's casts beside a model
    without FP8), which a user's own ``fp8_stats`` around the step must not see."""
    saved = list(_active)
    _active[:] = [stats]
    try:
        yield
    finally:
        _active[:] = saved


def stats_enabled() -> bool:
    return bool(_active)


def _decoded(codes: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """``decode(codes, fmt)``, by the host library's decode where it applies (the same values,
    several times faster than torch's float8 conversion)."""
    from . import host_library as _host

    values = _host.host_decode(codes, fmt.name, 0)
    return decode(codes, fmt) if values is None else values


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
    host = _host_figures(scaled, codes, fmt)
    if host is not None:
        _append(site, scaled.numel(), fmt, log2_scale, host)
        return
    with torch.no_grad():
        flat = scaled.reshape(-1)
        decoded = _decoded(codes, fmt).reshape(-1)
        amax = float(flat.abs().max()) if flat.numel() else 0.0
        finite_count = flat.numel()
        if not math.isfinite(amax):  # non-finite inputs count in none of the figures
            finite = torch.isfinite(flat)
            zero = torch.zeros((), dtype=flat.dtype)
            flat, decoded = torch.where(finite, flat, zero), torch.where(finite, decoded, zero)
            finite_count = int(finite.sum())
            amax = float(flat.abs().max())
        nonfinite = flat.numel() - finite_count
        zero_codes = torch.count_nonzero(codes == 0)
        if fmt.has_negative_zero:
            zero_codes = zero_codes + torch.count_nonzero(codes == fmt.sign_bit)
        # A dot product per energy, one pass each: float32 sums are ample for a ratio in dB.
        error = flat - decoded
        figures = torch.stack([
            torch.count_nonzero(flat).double(), zero_codes.double(),
            (torch.count_nonzero(scaled.abs() > fmt.max) if amax > fmt.max or nonfinite else
             torch.zeros(())).double(),
            torch.dot(flat, flat).double(), torch.dot(error, error).double(),
        ]).tolist()
    nonzero, zero_codes, saturated, signal_energy, error_energy = figures
    if math.isinf(signal_energy) or math.isinf(error_energy):  # float32 squares overflowed
        with torch.no_grad():
            signal_energy = float(flat.double().square().sum())
            error_energy = float(error.double().square().sum())
    _append(site, scaled.numel(), fmt, log2_scale,
            (finite_count, nonzero, zero_codes, saturated, signal_energy, error_energy, amax))


def record_values(site: Optional[str], x: torch.Tensor, values: torch.Tensor, fmt: FP8Format,
                  log2_scale: int) -> bool:
    """Record the cast of ``x`` (CPU float32) with scale ``2**log2_scale`` that gave the FP8
    ``values`` (``decode(codes) * 2**-log2_scale``), as :func:`record_cast` records it from
    the scaled input and the codes, in one pass of the host library over the two. False,
    nothing recorded, where that pass does not apply (then cast through codes instead)."""
    if not _active:
        return True
    if (fmt.sign_bit != 128 or x.device.type != "cpu" or x.dtype != torch.float32
            or values.dtype != torch.float32 or values.numel() != x.numel()
            or abs(log2_scale) > 31):
        return False
    from . import host_library as _host

    if not _host.fused_cast_available():
        return False
    figures = _host.value_figures(x.detach().contiguous(), values.contiguous(), log2_scale,
                                  fmt.max)
    if figures is None:
        return False
    _append(site, x.numel(), fmt, log2_scale, figures)
    return True


_DECODE_TABLES: Dict[str, torch.Tensor] = {}


def _host_figures(scaled: torch.Tensor, codes: torch.Tensor,
                  fmt: FP8Format) -> Optional[Tuple[float, ...]]:
    """:func:`record_cast`'s figures in one pass of the host library (its energies summed in
    float64), where it applies: 8-bit codes of a CPU float32 input; else None."""
    if (fmt.sign_bit != 128 or scaled.device.type != "cpu" or scaled.dtype != torch.float32
            or codes.dtype != torch.uint8 or codes.numel() != scaled.numel()):
        return None
    from . import host_library as _host

    if not _host.fused_cast_available():
        return None
    table = _DECODE_TABLES.get(fmt.name)
    if table is None:
        table = _DECODE_TABLES[fmt.name] = decode(torch.arange(256, dtype=torch.uint8), fmt)
    return _host.cast_figures(scaled.detach().contiguous(), codes.contiguous(), table,
                              fmt.sign_bit if fmt.has_negative_zero else None, fmt.max)


def _append(site: Optional[str], numel: int, fmt: FP8Format, log2_scale: int,
            figures: Tuple[float, ...]) -> None:
    """The record of a cast from its figures (see :func:`_host_figures`), to every active
    collection."""
    finite_count, nonzero, zero_codes, saturated, signal_energy, error_energy, amax = figures
    # Zeros (of either sign) encode to a zero code, non-finite values never do: the other zero
    # codes are the nonzero finite values that flushed.
    flushed = zero_codes - (finite_count - nonzero)
    unscale = math.ldexp(1.0, -int(log2_scale))
    if signal_energy == 0:
        sqnr = math.nan
    elif math.isnan(error_energy) or math.isinf(error_energy):
        sqnr = -math.inf  # a finite input became NaN or inf (the "nan" overflow policy)
    elif error_energy == 0:
        sqnr = math.inf
    else:
        sqnr = 10 * math.log10(signal_energy / error_energy)
    record = CastRecord(
        site=site or "<unnamed>",
        format=fmt.name,
        log2_scale=int(log2_scale),
        numel=numel,
        nonzero=int(nonzero),
        flushed=int(flushed),
        saturated=int(saturated),
        amax=amax * unscale,
        rms=math.sqrt(signal_energy / finite_count) * unscale if finite_count else math.nan,
        sqnr_db=sqnr,
    )
    for stats in _active:
        stats.records.append(record)
