"""The u-μP inspector: each parameter's role, multipliers, init scale and the learning rate the
optimizer really applies, with the parameters that stand out of their role flagged.

u-μP gives each tensor a learning rate of the global rate times a factor of its role (its
:class:`~ipu_unit_scaling.parametrization.umup.WeightRule`: embedding, hidden, output, norm,
bias; fan-in; residual depth). A model that does not learn under u-μP is most often one tensor
whose factor is not the rule's, or whose weight decay or schedule is not what was meant; this
shows every one of them side by side, from the optimizer's own parameter groups
(``python -m ipu_unit_scaling.apps.inspect`` on a run config, without training). For a
trained run, ``ipu-unit-scaling health RUN --params`` adds each parameter's measured
update/weight ratio from the run's telemetry.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from .mup_optimizers import LR_SCALE
from .umup import WeightRule, lr_scale, weight_rules

__all__ = ["ParameterReport", "parameter_roles", "umup_rules_of", "inspect_parameters",
           "format_parameter_table", "OUTLIER_FACTOR"]

# A parameter whose normalised learning rate or update ratio is this many times above or below
# the median of its role is flagged: u-μP's rules make these equal within a role, so a factor
# of 4 (two octaves) is far outside what fan-in rounding or depth gives.
OUTLIER_FACTOR = 4.0


def umup_rules_of(model: nn.Module) -> Optional[Dict[str, WeightRule]]:
    """u-μP's rule for every parameter of ``model`` (a given model's ``umup_rules()``, else the
    GPT layout's :func:`weight_rules`), or None where u-μP cannot type every parameter."""
    own = getattr(model, "umup_rules", None)
    try:
        rules = own() if callable(own) else weight_rules(model)
    except (ValueError, AttributeError, KeyError, TypeError):
        try:
            rules = weight_rules(model, readout=(), residual_blocks=())
        except (ValueError, AttributeError, KeyError, TypeError):
            return None
    return dict(rules)


def parameter_roles(model: nn.Module) -> Dict[str, str]:
    """Each parameter's u-μP type by name; "other" for one u-μP cannot type."""
    rules = umup_rules_of(model) or {}
    return {name: rules[name].weight_type if name in rules else "other"
            for name, _ in model.named_parameters()}


@dataclass
class ParameterReport:
    """One parameter as the optimizer trains it (see :func:`inspect_parameters`)."""

    name: str
    role: str
    shape: List[int]
    init_std: float
    lr_mult: float  # the factor on the global learning rate its group applies
    rule_mult: float  # u-μP's factor for its role (nan where u-μP has no rule)
    residual_depth: Optional[int]
    learning_rate: float  # what the optimizer applies at the inspected step
    weight_decay_per_step: float  # the fraction of the weight a decoupled decay removes a step
    update_ratio: float = math.nan  # measured over a run: the median of its sampled steps
    flags: List[str] = field(default_factory=list)


def inspect_parameters(model: nn.Module, optimizer: torch.optim.Optimizer, global_lr: float,
                       update_ratios: Optional[Mapping[str, float]] = None,
                       decoupled_decay: Optional[bool] = None) -> List[ParameterReport]:
    """A :class:`ParameterReport` for every trainable parameter of ``model``, in order.

    ``global_lr`` is the schedule's rate at the step inspected (the optimizer's groups hold
    ``global_lr * lr_mult`` once it is set). ``update_ratios`` (by name) are a run's measured
    update/weight ratios. ``decoupled_decay``: whether the optimizer's weight decay is a
    decoupled shrink (AdamW, and the package's SGD groups), by default from its class.

    Flags: a factor that differs from u-μP's rule for the parameter (when the model is typed
    by u-μP), a normalised learning rate (factor over rule) or an update ratio more than
    :data:`OUTLIER_FACTOR` times away from its role's median, and a parameter no group holds.
    """
    rules = umup_rules_of(model) or {}
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    if decoupled_decay is None:
        decoupled_decay = isinstance(optimizer, torch.optim.AdamW) or \
            type(optimizer).__name__ == "AdamW"
    reports: List[ParameterReport] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        rule = rules.get(name)
        group = groups.get(id(param))
        flags: List[str] = []
        if group is None:
            flags.append("no optimizer group holds it: never trained")
            lr_mult, rate, decay = math.nan, math.nan, math.nan
        else:
            lr_mult = float(group.get(LR_SCALE, float(group["lr"]) / global_lr))
            rate = global_lr * lr_mult
            wd = float(group.get("weight_decay", 0.0))
            decay = rate * wd if decoupled_decay else math.nan
        with torch.no_grad():
            std = float(param.detach().double().std()) if param.numel() > 1 else math.nan
        reports.append(ParameterReport(
            name=name, role=rule.weight_type if rule else "other", shape=list(param.shape),
            init_std=std, lr_mult=lr_mult, rule_mult=lr_scale(rule) if rule else math.nan,
            residual_depth=rule.residual_depth if rule else None, learning_rate=rate,
            weight_decay_per_step=decay,
            update_ratio=float((update_ratios or {}).get(name, math.nan)), flags=flags))
    _flag_outliers(reports)
    return reports


def _flag_outliers(reports: Sequence[ParameterReport]) -> None:
    umup = [r for r in reports if math.isfinite(r.rule_mult) and math.isfinite(r.lr_mult)]
    # The model is trained by u-μP's rules when most of its factors are the rules': then one
    # that is not is a mistake, not a different parametrization.
    agree = [r for r in umup if math.isclose(r.lr_mult, r.rule_mult, rel_tol=1e-6)]
    if umup and len(agree) * 2 > len(umup):
        for r in umup:
            if not math.isclose(r.lr_mult, r.rule_mult, rel_tol=1e-6):
                r.flags.append(f"learning-rate factor {r.lr_mult:.4g} is not u-μP's "
                               f"{r.rule_mult:.4g} for a {r.role} tensor")
    by_role: Dict[str, List[ParameterReport]] = {}
    for r in reports:
        by_role.setdefault(r.role, []).append(r)
    for members in by_role.values():
        normalised = {r.name: r.lr_mult / r.rule_mult for r in members
                      if math.isfinite(r.rule_mult) and math.isfinite(r.lr_mult) and r.rule_mult}
        _flag_far(members, normalised, "learning rate, over u-μP's factor,")
        ratios = {r.name: r.update_ratio for r in members
                  if math.isfinite(r.update_ratio) and r.update_ratio > 0}
        _flag_far(members, ratios, "update/weight ratio")


def _flag_far(members: Sequence[ParameterReport], values: Mapping[str, float],
              what: str) -> None:
    if len(values) < 3:  # no median to stand out of
        return
    median = statistics.median(values.values())
    if not median > 0:
        return
    for r in members:
        value = values.get(r.name)
        if value is not None and not 1 / OUTLIER_FACTOR <= value / median <= OUTLIER_FACTOR:
            r.flags.append(f"{what} {value:.3g} is {value / median:.3g}x the median of its "
                           f"role ({r.role}, {median:.3g})")


def format_parameter_table(reports: Sequence[ParameterReport]) -> str:
    """The reports as a fixed-width table, flagged parameters marked with ``!``."""
    header = ("", "parameter", "role", "shape", "init std", "lr mult", "u-μP mult", "lr",
              "decay/step", "update/weight")
    rows = [header]
    for r in reports:
        rows.append(("!" if r.flags else "", r.name, r.role, "x".join(map(str, r.shape)),
                     _g(r.init_std), _g(r.lr_mult), _g(r.rule_mult), _g(r.learning_rate),
                     _g(r.weight_decay_per_step), _g(r.update_ratio)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in rows]
    for r in reports:
        lines += [f"! {r.name}: {flag}" for flag in r.flags]
    return "\n".join(lines)


def _g(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.4g}"
