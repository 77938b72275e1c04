"""Early warnings from a run's telemetry, and the health summary of a run directory.

:class:`HealthMonitor` reads each sampled step's telemetry rows (and every step's loss) as the
run makes them and returns a warning row for each threshold crossed
(:class:`TelemetryConfig`, the run config's ``telemetry`` section): one line naming the step, the
site and what crossed which threshold. It warns once per (site, kind) until that site
recovers, so a layer that stays out of range is one line, not one per step. Kinds:

- ``flushed``: a cast site's flushed fraction passes ``flushed_warning``;
- ``saturated``: its saturated fraction passes ``saturated_warning``;
- ``range``: its scaled RMS comes within ``range_margin`` binades of the format's largest
  value, or its scaling bias within ``range_margin`` of the clamp at +-31 (AMAX scaling has
  run out of room to follow the tensor);
- ``update_ratio``: a parameter's update/weight ratio passes ``update_ratio_max``, or is more
  than ``update_ratio_spread`` times the median of its role;
- ``attention_logit``: an attention layer's largest logit passes ``attention_logit_max``;
- ``loss_spike``: a step's training loss is more than ``loss_spike`` above the mean of the
  ten steps before it, relatively;
- ``nonfinite``: a cast site's flushed or saturated fraction or its amax is NaN or infinite,
  or its SQNR is -inf (the cast turned finite values into NaN or inf). An SQNR of +inf is an
  exact cast, and healthy.

The thresholds know the recipe (:func:`checks_by_design`): what a recipe's scales do by design
is not a warning. A recipe that scales groups (rowwise, block, mx, nvfp4) puts each group's
largest value at the top of the format, so a tensor's RMS near the top is its aim, not a risk;
mx's E8M0 and nvfp4's E4M3 scales have no +-31 clamp; and mx's floor rule (OCP) and nvfp4's
rounded scales let a group's largest values pass the format's largest by less than a binade,
which saturate by design. An FP4 or FP6 element (E2M1, E2M3, E3M2) spans a few binades, so the
values of a group far below its largest flush by design: these casts do not warn of flushing.

:func:`run_health` summarises a run's telemetry file per site for ``ipu-unit-scaling health``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from ..fp8.fp8_config import GROUPED_SCALINGS, FP8Config
from ..fp8.fp8_formats import SUB_BYTE_FORMATS, get_format

__all__ = ["TelemetryConfig", "telemetry_problems", "checks_by_design", "HealthMonitor",
           "WARNING_KINDS",
           "AS_IF_CAST", "nonfinite_cast_fields", "run_health", "format_health_table"]

WARNING_KINDS = ("flushed", "saturated", "range", "update_ratio", "attention_logit",
                 "loss_spike", "nonfinite")
AS_IF_CAST = "as if cast: the run is not FP8"  # cast rows of a run without FP8
MAX_LOG2_SCALE = 31  # the clamp of the AMAX rule's scaling bias
_LOSS_WINDOW = 10


@dataclass(frozen=True)
class TelemetryConfig:
    """The ``telemetry`` section of a run config: how often telemetry samples a step, and the
    thresholds of the early warnings (:mod:`ipu_unit_scaling.training.run_health`).

    - ``interval``: steps between sampled steps (and the powers of two below it); 0 turns
      telemetry off.
    - ``flushed_warning``: a cast site's flushed fraction (of its nonzero values) that warns.
    - ``saturated_warning``: a cast site's saturated fraction that warns.
    - ``range_margin``: binades; warns when a cast's scaled RMS comes within this many binades
      of the format's largest value, or its scaling bias within this of the clamp (+-31).
    - ``update_ratio_spread``: warns when a parameter's update/weight ratio is this many times
      above the median of its role at that step.
    - ``update_ratio_max``: warns when a parameter's update/weight ratio passes this.
    - ``attention_logit_max``: warns when an attention layer's largest logit passes this.
    - ``loss_spike``: warns when a step's training loss is more than this fraction above the
      running mean of the steps before it.
    """

    # The thresholds' defaults come from healthy and broken runs of the default GPT
    # (docs/guide/health.md): each sits between the worst healthy run and the first sign of a
    # broken one.
    interval: int = 50
    flushed_warning: float = 0.1
    saturated_warning: float = 0.001
    range_margin: float = 1.0
    update_ratio_spread: float = 10.0
    update_ratio_max: float = 0.25
    attention_logit_max: float = 100.0
    loss_spike: float = 0.25


def telemetry_problems(config: TelemetryConfig) -> List[Tuple[str, str]]:
    """(key, message) for each field of ``config`` out of its range."""
    problems: List[Tuple[str, str]] = []
    if config.interval < 0:
        problems.append(("interval", f"got {config.interval}; allowed: 0 (off) or more"))
    for name in ("flushed_warning", "saturated_warning"):
        value = getattr(config, name)
        if not 0.0 < value <= 1.0:
            problems.append((name, f"got {value!r}; allowed: 0 < x <= 1 (a fraction)"))
    for name, low in (("range_margin", 0.0), ("update_ratio_spread", 1.0),
                      ("update_ratio_max", 0.0), ("attention_logit_max", 0.0),
                      ("loss_spike", 0.0)):
        value = getattr(config, name)
        if not (math.isfinite(value) and value > low):
            problems.append((name, f"got {value!r}; allowed: a finite number > {low:g}"))
    return problems


def checks_by_design(fp8: Optional[FP8Config]) -> FrozenSet[str]:
    """The cast checks that recipe ``fp8`` meets by design, which therefore warn of nothing:
    ``range_rms`` (a tensor's RMS near the format's top) under the group recipes,
    ``range_clamp`` (a scaling bias near +-31) where the scales are not the AMAX rule's (mx,
    nvfp4), ``saturated`` under mx's floor rule and nvfp4 (see the module docstring)."""
    if fp8 is None or fp8.scaling not in GROUPED_SCALINGS:
        return frozenset()
    exempt = {"range_rms"}
    if fp8.scaling in ("mx", "nvfp4"):
        exempt.add("range_clamp")
    if fp8.scaling == "nvfp4" or (fp8.scaling == "mx" and fp8.scale_rounding == "floor"):
        exempt.add("saturated")
    return frozenset(exempt)


class HealthMonitor:
    """Turns telemetry rows into warning rows (see the module docstring). ``fp8``: the recipe
    of the casts, whose by-design behaviour is not warned of (:func:`checks_by_design`)."""

    def __init__(self, config: TelemetryConfig, fp8: Optional[FP8Config] = None) -> None:
        self.config = config
        self.exempt = checks_by_design(fp8)
        self.active: Set[Tuple[str, str]] = set()
        self.losses: Deque[float] = deque(maxlen=_LOSS_WINDOW)

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run warns as the uninterrupted one."""
        return {"active": sorted(list(pair) for pair in self.active),
                "losses": list(self.losses)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.active = {(str(site), str(kind)) for site, kind in state.get("active", [])}
        self.losses = deque((float(v) for v in state.get("losses", [])), maxlen=_LOSS_WINDOW)

    def check(self, rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Warning rows for one step's telemetry rows (loss rows included)."""
        found: Dict[Tuple[str, str], Tuple[int, str]] = {}
        checked: Set[Tuple[str, str]] = set()
        ratios: Dict[str, List[float]] = {}
        for row in rows:
            if row.get("kind") == "param" and _finite(row.get("update_ratio")):
                ratios.setdefault(row["role"], []).append(row["update_ratio"])
        for row in rows:
            kind = row.get("kind")
            if kind == "cast" and not row.get("note"):  # (not a cast the run makes)
                self._check_cast(row, found, checked)
            elif kind == "param":
                self._check_param(row, ratios.get(row["role"], []), found, checked)
            elif kind == "attention":
                checked.add((row["site"], "attention_logit"))
                if _finite(row.get("amax")) and row["amax"] > self.config.attention_logit_max:
                    found[(row["site"], "attention_logit")] = (row["step"], (
                        f"largest attention logit {row['amax']:.4g} > attention_logit_max "
                        f"{self.config.attention_logit_max:g}"))
            elif kind == "loss":
                self._check_loss(row, found, checked)
        # Sites checked and not found out of bounds have recovered: they may warn again.
        self.active -= checked - set(found)
        warnings = []
        for (site, kind), (step, what) in found.items():
            if (site, kind) in self.active:
                continue
            self.active.add((site, kind))
            warnings.append(dict(step=step, kind="warning", site=site, role=kind,
                                 note=f"warning: step {step}: {site}: {what}"))
        return warnings

    def _check_cast(self, row: Dict[str, Any], found: Dict[Tuple[str, str], Tuple[int, str]],
                    checked: Set[Tuple[str, str]]) -> None:
        site, step, config = row["site"], row["step"], self.config
        for kind in ("flushed", "saturated", "range", "nonfinite"):
            checked.add((site, kind))
        nonfinite = nonfinite_cast_fields(row)
        if nonfinite:
            found[(site, "nonfinite")] = (step, _nonfinite_text(nonfinite))
        flushed = _number(row.get("flushed_fraction"))
        saturated = _number(row.get("saturated_fraction"))
        # An FP4/FP6 element spans a few binades (E2M1: 6 down to 0.5): a group's values more
        # than that below its largest flush by design, not for want of scale.
        if flushed is not None and flushed > config.flushed_warning and \
                str(row.get("format")).upper() not in SUB_BYTE_FORMATS:
            found[(site, "flushed")] = (step, f"{flushed:.1%} of its nonzero {row['role']} "
                                              f"values flushed to zero in {row['format']} > "
                                              f"flushed_warning {config.flushed_warning:g}")
        if saturated is not None and saturated > config.saturated_warning and \
                "saturated" not in self.exempt:
            found[(site, "saturated")] = (step, f"{saturated:.2%} of its {row['role']} values "
                                                f"saturated {row['format']} > saturated_warning "
                                                f"{config.saturated_warning:g}")
        scale, rms = _number(row.get("log2_scale")), _number(row.get("rms"))
        try:
            top = math.log2(get_format(row["format"]).max)
        except (ValueError, KeyError):
            return
        if scale is None:
            return
        if abs(scale) > MAX_LOG2_SCALE - config.range_margin and \
                "range_clamp" not in self.exempt:
            found[(site, "range")] = (step, f"scaling bias {int(scale)} within "
                                            f"{config.range_margin:g} of the clamp at "
                                            f"+-{MAX_LOG2_SCALE} (range_margin)")
        elif rms is not None and rms > 0 and "range_rms" not in self.exempt and \
                math.log2(rms) + scale > top - config.range_margin:
            found[(site, "range")] = (step, f"RMS {rms:.3g} at scaling bias {int(scale)} is "
                                            f"within {config.range_margin:g} binades of "
                                            f"{row['format']}'s largest value (range_margin)")

    def _check_param(self, row: Dict[str, Any], role_ratios: List[float],
                     found: Dict[Tuple[str, str], Tuple[int, str]],
                     checked: Set[Tuple[str, str]]) -> None:
        site, ratio, config = row["site"], _number(row.get("update_ratio")), self.config
        checked.add((site, "update_ratio"))
        if ratio is None:
            return
        if ratio > config.update_ratio_max:
            found[(site, "update_ratio")] = (row["step"], (
                f"update/weight ratio {ratio:.3g} > update_ratio_max "
                f"{config.update_ratio_max:g}"))
            return
        if len(role_ratios) >= 3:
            median = sorted(role_ratios)[len(role_ratios) // 2]
            if median > 0 and ratio > config.update_ratio_spread * median:
                found[(site, "update_ratio")] = (row["step"], (
                    f"update/weight ratio {ratio:.3g} is {ratio / median:.3g}x the median of "
                    f"its role ({row['role']}, {median:.3g}) > update_ratio_spread "
                    f"{config.update_ratio_spread:g}"))

    def _check_loss(self, row: Dict[str, Any], found: Dict[Tuple[str, str], Tuple[int, str]],
                    checked: Set[Tuple[str, str]]) -> None:
        raw = row.get("amax")
        loss = _number(raw)
        checked.add(("loss", "loss_spike"))
        if len(self.losses) == self.losses.maxlen and loss is not None:
            mean = sum(self.losses) / len(self.losses)
            if mean > 0 and loss > (1 + self.config.loss_spike) * mean:
                found[("loss", "loss_spike")] = (row["step"], (
                    f"training loss {loss:.4f} is {loss / mean - 1:.0%} above the mean of the "
                    f"{len(self.losses)} steps before it ({mean:.4f}) > loss_spike "
                    f"{self.config.loss_spike:g}"))
        if loss is not None:
            self.losses.append(loss)
        elif raw is not None:
            found[("loss", "loss_spike")] = (row["step"], f"training loss is {raw}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _number(value: Any) -> Optional[float]:
    """``value`` as a float when it is a finite number, else None."""
    return float(value) if _finite(value) else None


def nonfinite_cast_fields(row: Dict[str, Any]) -> Dict[str, float]:
    """The fields of a cast row whose non-finite value means something went wrong: a NaN or
    infinite flushed or saturated fraction or amax, an SQNR of -inf. (An empty cell reads as
    NaN; the recorder leaves none of these empty.)"""
    bad = {name: float(row[name]) for name in ("flushed_fraction", "saturated_fraction", "amax")
           if isinstance(row.get(name), float) and not math.isfinite(row[name])}
    if row.get("sqnr_db") == -math.inf:
        bad["sqnr_db"] = -math.inf
    return bad


def _nonfinite_text(fields: Dict[str, float]) -> str:
    return ", ".join(f"{name} is {value!r}" for name, value in fields.items()) + \
        " (non-finite)"


def run_health(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The health document of a run's telemetry rows: per cast site the worst flushed and
    saturated fractions with their steps, the range of its scaling bias, the lowest and the
    last SQNR; per attention layer its largest logit; every warning with its step, site and
    kind; the steps sampled."""
    sites: Dict[str, Dict[str, Any]] = {}
    attention: Dict[str, Dict[str, Any]] = {}
    warnings: List[Dict[str, Any]] = []
    derived: List[Dict[str, Any]] = []  # non-finite values the run's monitor did not warn of
    steps: Set[int] = set()
    for row in rows:
        kind, site, step = row["kind"], row["site"], row["step"]
        if kind == "cast":
            steps.add(step)
            entry = sites.setdefault(site, dict(
                site=site, role=row["role"], format=row["format"], worst_flushed=-1.0,
                worst_flushed_step=None, worst_saturated=-1.0, worst_saturated_step=None,
                log2_scale_min=math.inf, log2_scale_max=-math.inf, sqnr_db_min=None,
                sqnr_db_last=math.nan, note=row["note"], nonfinite=[]))
            nonfinite = nonfinite_cast_fields(row)
            seen = {item["field"] for item in entry["nonfinite"]}
            for name, value in nonfinite.items():
                if name not in seen:
                    entry["nonfinite"].append(dict(field=name, value=value, step=step))
            if nonfinite and not row["note"]:
                derived.append(dict(step=step, site=site, kind="nonfinite", message=(
                    f"warning: step {step}: {site}: {_nonfinite_text(nonfinite)}")))
            if _finite(row["flushed_fraction"]) and row["flushed_fraction"] > \
                    entry["worst_flushed"]:
                entry["worst_flushed"], entry["worst_flushed_step"] = \
                    row["flushed_fraction"], step
            if _finite(row["saturated_fraction"]) and row["saturated_fraction"] > \
                    entry["worst_saturated"]:
                entry["worst_saturated"], entry["worst_saturated_step"] = \
                    row["saturated_fraction"], step
            if _finite(row["log2_scale"]):
                entry["log2_scale_min"] = min(entry["log2_scale_min"], int(row["log2_scale"]))
                entry["log2_scale_max"] = max(entry["log2_scale_max"], int(row["log2_scale"]))
            if not math.isnan(row["sqnr_db"]):
                entry["sqnr_db_min"] = row["sqnr_db"] if entry["sqnr_db_min"] is None else \
                    min(entry["sqnr_db_min"], row["sqnr_db"])
                entry["sqnr_db_last"] = row["sqnr_db"]
        elif kind == "attention":
            entry = attention.setdefault(site, dict(site=site, largest_logit=-math.inf,
                                                    step=None))
            if _finite(row["amax"]) and row["amax"] > entry["largest_logit"]:
                entry["largest_logit"], entry["step"] = row["amax"], step
        elif kind == "warning":
            warnings.append(dict(step=step, site=site, kind=row["role"], message=row["note"]))
    for entry in sites.values():
        for key in ("log2_scale_min", "log2_scale_max"):
            if not math.isfinite(entry[key]):
                entry[key] = None
        for key in ("worst_flushed", "worst_saturated"):
            if entry[key] < 0:
                entry[key] = None
    # A run's monitor warns of each non-finite site once until it recovers: the first of each
    # site's non-finite rows it did not warn of is added (a file from before this check, or
    # edited), once per site.
    warned = {(w["site"], w["kind"]) for w in warnings}
    for warning in derived:
        if (warning["site"], "nonfinite") not in warned:
            warned.add((warning["site"], "nonfinite"))
            warnings.append(warning)
    warnings.sort(key=lambda w: w["step"])
    as_if_cast = any(s["note"] == AS_IF_CAST for s in sites.values())
    return {"sampled_steps": sorted(steps), "as_if_cast": as_if_cast,
            "sites": list(sites.values()), "attention": list(attention.values()),
            "warnings": warnings}


def format_health_table(health: Dict[str, Any]) -> str:
    """The health document as the table ``ipu-unit-scaling health`` prints."""
    header: Tuple[str, ...] = ("site", "role", "format", "worst flushed (step)",
                               "worst saturated (step)", "scaling bias", "SQNR dB min/last")
    nonfinite = any(s.get("nonfinite") for s in health["sites"])
    if nonfinite:  # a column of its own, only when some site has one
        header += ("non-finite (first step)",)
    rows: List[Tuple[str, ...]] = [header]
    for s in health["sites"]:
        row: Tuple[str, ...] = (
            s["site"], s["role"], s["format"],
            _fraction(s["worst_flushed"], s["worst_flushed_step"]),
            _fraction(s["worst_saturated"], s["worst_saturated_step"]),
            "-" if s["log2_scale_min"] is None else
            f"{s['log2_scale_min']}..{s['log2_scale_max']}",
            f"{_db(s['sqnr_db_min'])}/{_db(s['sqnr_db_last'])}")
        if nonfinite:
            row += (", ".join(f"{n['field']} {n['value']!r} ({n['step']})"
                              for n in s.get("nonfinite", [])) or "-",)
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    steps = health["sampled_steps"]
    lines.insert(0, f"{len(steps)} sampled steps" + (f" ({steps[0]}..{steps[-1]})"
                                                      if steps else ""))
    if health.get("as_if_cast"):
        lines.insert(1, f"{AS_IF_CAST}: each cast row is what a static cast to FP8 would "
                        "do to a linear layer's tensor, made beside it; these raise no warnings")
    for a in health["attention"]:
        lines.append(f"{a['site']}: largest attention logit {a['largest_logit']:.4g} "
                     f"(step {a['step']})")
    lines.append(f"{len(health['warnings'])} warnings")
    lines += [w["message"] for w in health["warnings"]]
    return "\n".join(lines)


def _fraction(value: Optional[float], step: Optional[int]) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.2%} ({step})"


def _db(value: Optional[float]) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.1f}"
