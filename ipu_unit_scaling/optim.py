"""Optimizers for u-μP: each tensor's learning rate scaled by its type, fan-in and depth.

``Adam``, ``AdamW`` and ``SGD`` are ``torch.optim``'s, built from the parameter groups of
:func:`param_groups`: one group per distinct (type, learning-rate scale), whose ``lr`` is the
global learning rate times :func:`ipu_unit_scaling.umup.lr_scale` and whose ``lr_scale`` key
records that factor, so that a schedule changes every group at once with
:func:`set_learning_rate`. The groups are plain dicts of ``lr`` and ``weight_decay``, which is
how PopTorch's optimizers take per-parameter hyperparameters: the IPU backend passes the same
groups to ``poptorch.optim``.

Weight decay is the paper's independent weight decay where the decay is decoupled from the
gradient (AdamW, and SGD, whose decay step is ``lr * weight_decay * w``): each group's decay is
divided by its peak learning rate, so a step shrinks weights by ``weight_decay`` times the
schedule's fraction, whatever the peak rate or the tensor's scale. Adam's weight decay is an L2
term added to the gradient, which Adam then normalises; it is passed on unchanged.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .umup import WeightRule, lr_scale, weight_rules

__all__ = ["LR_SCALE", "param_groups", "set_learning_rate", "Adam", "AdamW", "SGD"]

LR_SCALE = "lr_scale"  # the param-group key holding the group's factor on the global rate


def param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    independent_weight_decay: bool = True,
    parameters: Optional[Iterable[nn.Parameter]] = None,
    rules: Optional[Mapping[str, WeightRule]] = None,
) -> List[Dict[str, Any]]:
    """u-μP parameter groups for ``model``'s parameters (or the subset ``parameters``).

    ``rules`` defaults to :func:`ipu_unit_scaling.umup.weight_rules` of the model (the GPT's
    layout: readout ``head``, residual blocks ``layers``). With ``independent_weight_decay`` each
    group's ``weight_decay`` is ``weight_decay / (lr * lr_scale)``, for optimizers whose decay
    step is multiplied by the learning rate. The groups come in the model's parameter order, so
    the same model always gives the same groups (as loading an optimizer state requires).
    """
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be positive")
    rules = rules if rules is not None else weight_rules(model)
    wanted = None if parameters is None else {id(p) for p in parameters}
    groups: Dict[Tuple[str, float], Dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if wanted is not None and id(param) not in wanted:
            continue
        if name not in rules:
            raise ValueError(f"no u-μP rule for parameter {name!r}")
        rule = rules[name]
        scale = lr_scale(rule)
        group = groups.get((rule.weight_type, scale))
        if group is None:
            decay = weight_decay / (lr * scale) if independent_weight_decay else weight_decay
            group = {"params": [], "lr": lr * scale, "weight_decay": decay, LR_SCALE: scale}
            groups[(rule.weight_type, scale)] = group
        group["params"].append(param)
    if wanted is not None and sum(len(g["params"]) for g in groups.values()) != len(wanted):
        raise ValueError("some parameters passed are not parameters of the model")
    return list(groups.values())


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the global learning rate: each group gets ``lr`` times its ``lr_scale`` (1 for
    groups without one, so any optimizer works)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get(LR_SCALE, 1.0)


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` with u-μP's per-tensor learning rates (weight decay: L2, as is)."""

    def __init__(self, model: nn.Module, lr: float = 1.0, weight_decay: float = 0.0,
                 rules: Optional[Mapping[str, WeightRule]] = None, **kwargs: Any) -> None:
        groups = param_groups(model, lr, weight_decay, independent_weight_decay=False,
                              rules=rules)
        super().__init__(groups, lr=lr, **kwargs)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with u-μP's per-tensor learning rates and independent weight
    decay (a step decays weights by ``weight_decay`` times the schedule's fraction)."""

    def __init__(self, model: nn.Module, lr: float = 1.0, weight_decay: float = 0.0,
                 rules: Optional[Mapping[str, WeightRule]] = None, **kwargs: Any) -> None:
        super().__init__(param_groups(model, lr, weight_decay, rules=rules), lr=lr, **kwargs)


class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` with u-μP's per-tensor learning rates and independent weight decay.

    Meant for unit-scaled gradients (``U.cross_entropy`` and the other unit-scaled losses give
    them), where an SGD step has the size of an Adam step; see :func:`umup.lr_scale`.
    """

    def __init__(self, model: nn.Module, lr: float = 1.0, weight_decay: float = 0.0,
                 rules: Optional[Mapping[str, WeightRule]] = None, **kwargs: Any) -> None:
        super().__init__(param_groups(model, lr, weight_decay, rules=rules), lr=lr, **kwargs)
