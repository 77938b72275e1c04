"""Optimizers for u-μP: each tensor's learning rate scaled by its type, fan-in and depth.

``Adam``, ``AdamW`` and ``SGD`` are ``torch.optim``'s with u-μP's per-tensor learning rates.
They take either of two things:

- **parameters** (an iterable of tensors or of parameter groups), as in unit_scaling: each
  parameter must be a u-μP parameter (:mod:`ipu_unit_scaling.parameter`: a ``mup_type`` and a
  ``mup_scaling_depth``, as ``uu`` modules and ``uu.DepthSequential`` set them), and gets its
  own group from :func:`scaled_parameters`;
- **a model** (this package's form): the parameter types come from the model's layout,
  :func:`ipu_unit_scaling.parametrization.umup.weight_rules` (readout ``head``, residual blocks
  ``layers``),
  grouped by :func:`param_groups`.

Either way a group's ``lr`` is the global learning rate times the tensor's factor, recorded
under the group's ``lr_scale`` key so that a schedule changes every group at once with
:func:`set_learning_rate`. The groups are plain dicts of ``lr`` and ``weight_decay``, which is
how PopTorch's optimizers take per-parameter hyperparameters.

Weight decay is the paper's independent weight decay where the decay is decoupled from the
learning rate: each group's decay is divided by its peak learning rate, so a step shrinks
weights by ``weight_decay`` times the schedule's fraction, whatever the peak rate or the
tensor's scale. That is the default for parameters (as in unit_scaling) and, for a model, for
AdamW and SGD; a model's Adam keeps its weight decay as an L2 term, passed on unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ..modules.mup_parameter import has_parameter_data
from .umup import WeightRule, lr_scale, weight_rules

__all__ = [
    "LR_SCALE", "param_groups", "set_learning_rate", "lr_scale_for_depth", "lr_scale_func_adam",
    "lr_scale_func_sgd", "scaled_parameters", "Adam", "AdamW", "SGD",
]

LR_SCALE = "lr_scale"  # the param-group key holding the group's factor on the global rate

LrScaleFunc = Callable[[Any], float]
Params = Union[Iterable[Tensor], Iterable[Dict[str, Any]]]


# ---------------------------------------------------------------- parameters (unit_scaling's form)


def lr_scale_for_depth(param: Any) -> float:
    """`mup_scaling_depth**-0.5` for a parameter inside a residual stack, else 1 (depth-μP)."""
    depth = param.mup_scaling_depth
    return 1.0 if depth is None else depth**-0.5


def _fan_in(param: Any) -> int:
    """A tensor's fan-in: its width for a vector, its inputs for a matrix (for an embedding
    table, the width it writes), in channels times kernel size for a convolution."""
    shape = tuple(param.shape)
    if len(shape) == 1:
        return shape[0]
    if len(shape) in (2, 3):
        return int(torch.Size(shape[1:]).numel())
    raise ValueError(f"u-μP has no fan-in for a parameter of shape {shape} (4 or more dims)")


def lr_scale_func_adam(param: Any) -> float:
    """The factor on Adam's (and AdamW's) learning rate for one u-μP parameter: `fan_in**-0.5`
    for a "weight", 1 for "bias", "norm" and "output"; times `lr_scale_for_depth`."""
    depth = lr_scale_for_depth(param)
    if param.mup_type == "weight":
        return depth * _fan_in(param) ** -0.5
    if param.mup_type in ("bias", "norm", "output"):
        return depth
    raise ValueError(f"unknown mup_type {param.mup_type!r}")


def lr_scale_func_sgd(readout_constraint: Optional[str]) -> LrScaleFunc:
    """The learning-rate factor for SGD, which depends on the readout's constraint (the
    `constraint` of the model's `uu.LinearReadout`), as unit_scaling defines it.

    Without one, every weight's gradient is unit scaled, so an SGD step at initialisation is as
    large as an Adam step: Adam's factors. With `"to_output_scale"` the readout's backward
    takes its forward scale (`1 / fan_in`) and the gradients below it are μP's, not unit:
    "bias" and "norm" rates are then times their width, "weight" rates times `sqrt(fan_in)`,
    "output" as Adam's; all times the depth factor.
    """
    if readout_constraint is None:
        return lr_scale_func_adam
    if readout_constraint != "to_output_scale":
        raise ValueError(f"readout_constraint={readout_constraint!r}: SGD's rates are defined "
                         "for None and 'to_output_scale'")

    def scale(param: Any) -> float:
        depth = lr_scale_for_depth(param)
        if param.mup_type in ("bias", "norm"):
            return depth * param.shape[0]
        if param.mup_type == "weight":
            return depth * _fan_in(param) ** 0.5
        if param.mup_type == "output":
            return depth
        raise ValueError(f"unknown mup_type {param.mup_type!r}")

    return scale


def scaled_parameters(
    params: Params,
    lr_scale_func: LrScaleFunc,
    lr: Union[None, float, Tensor] = None,
    weight_decay: float = 0,
    independent_weight_decay: bool = True,
    allow_non_unit_scaling_params: bool = False,
) -> List[Dict[str, Any]]:
    """One parameter group per parameter, its `lr` times `lr_scale_func(param)`.

    `params` are tensors or parameter groups (dicts, whose own `lr`, `weight_decay` and other
    keys win over the arguments). A tensor learning rate is kept a tensor (cloned per group).
    With `independent_weight_decay` each group's `weight_decay` is divided by its learning rate.
    A parameter without u-μP's fields raises ValueError unless
    `allow_non_unit_scaling_params`, which gives it the unscaled rate.
    """
    groups: List[Dict[str, Any]] = []
    for entry in params:
        group: Dict[str, Any] = ({"params": [entry]} if isinstance(entry, Tensor)
                                 else dict(entry))  # type: ignore[arg-type]
        group_lr = group.get("lr", lr)
        if group_lr is None:
            raise ValueError("scaled_parameters needs lr, or an lr in every parameter group")
        group_decay = group.get("weight_decay", weight_decay)
        others = {k: v for k, v in group.items() if k not in ("params", "lr", "weight_decay")}
        members = group["params"]
        for param in [members] if isinstance(members, Tensor) else members:
            if has_parameter_data(param):
                factor = lr_scale_func(param)
            elif allow_non_unit_scaling_params:
                factor = 1.0
            else:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} has no mup_type: "
                                 "not a u-μP parameter (pass allow_non_unit_scaling_params=True "
                                 "to give it the unscaled learning rate)")
            param_lr = group_lr.clone() * factor if isinstance(group_lr, Tensor) else (
                group_lr * factor)
            decay = group_decay / float(param_lr) if independent_weight_decay else group_decay
            groups.append({"params": [param], "lr": param_lr, "weight_decay": decay,
                           LR_SCALE: factor, **others})
    return groups


# ---------------------------------------------------------------- a model (this package's form)


def param_groups(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    independent_weight_decay: bool = True,
    parameters: Optional[Iterable[nn.Parameter]] = None,
    rules: Optional[Mapping[str, WeightRule]] = None,
) -> List[Dict[str, Any]]:
    """u-μP parameter groups for ``model``'s parameters (or the subset ``parameters``).

    ``rules`` defaults to :func:`ipu_unit_scaling.parametrization.umup.weight_rules` of the model
    (the GPT's
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


def _groups(params: Union[nn.Module, Params], lr: Union[float, Tensor], weight_decay: float,
            independent_weight_decay: Optional[bool], model_independent: bool,
            allow_non_unit_scaling_params: bool, rules: Optional[Mapping[str, WeightRule]],
            lr_scale_func: LrScaleFunc) -> List[Dict[str, Any]]:
    if isinstance(params, nn.Module):
        independent = model_independent if independent_weight_decay is None else (
            independent_weight_decay)
        return param_groups(params, float(lr), weight_decay, independent, rules=rules)
    if rules is not None:
        raise ValueError("rules= is for a model; parameters carry their own u-μP types")
    independent = True if independent_weight_decay is None else independent_weight_decay
    return scaled_parameters(params, lr_scale_func, lr, weight_decay, independent,
                             allow_non_unit_scaling_params)


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` with u-μP's per-tensor learning rates (see the module docstring);
    `params` are parameters (or groups) or a model."""

    def __init__(self, params: Union[nn.Module, Params], lr: Union[float, Tensor] = 1e-3,
                 *args: Any, weight_decay: float = 0.0,
                 independent_weight_decay: Optional[bool] = None,
                 allow_non_unit_scaling_params: bool = False,
                 rules: Optional[Mapping[str, WeightRule]] = None, **kwargs: Any) -> None:
        groups = _groups(params, lr, weight_decay, independent_weight_decay, False,
                         allow_non_unit_scaling_params, rules, lr_scale_func_adam)
        super().__init__(groups, lr, *args, **kwargs)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with u-μP's per-tensor learning rates and independent weight
    decay (a step decays weights by ``weight_decay`` times the schedule's fraction)."""

    def __init__(self, params: Union[nn.Module, Params], lr: Union[float, Tensor] = 1e-3,
                 *args: Any, weight_decay: float = 0.0,
                 independent_weight_decay: Optional[bool] = None,
                 allow_non_unit_scaling_params: bool = False,
                 rules: Optional[Mapping[str, WeightRule]] = None, **kwargs: Any) -> None:
        groups = _groups(params, lr, weight_decay, independent_weight_decay, True,
                         allow_non_unit_scaling_params, rules, lr_scale_func_adam)
        super().__init__(groups, lr, *args, **kwargs)


class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` with u-μP's per-tensor learning rates and independent weight decay.

    Meant for unit-scaled gradients (``U.cross_entropy`` and the other unit-scaled losses give
    them), where an SGD step has the size of an Adam step. ``readout_constraint`` is the
    ``constraint`` of the model's ``uu.LinearReadout`` (see :func:`lr_scale_func_sgd`); for a
    model, only None.
    """

    def __init__(self, params: Union[nn.Module, Params], lr: Union[float, Tensor] = 1e-3,
                 *args: Any, weight_decay: float = 0.0,
                 independent_weight_decay: Optional[bool] = None,
                 allow_non_unit_scaling_params: bool = False,
                 readout_constraint: Optional[str] = None,
                 rules: Optional[Mapping[str, WeightRule]] = None, **kwargs: Any) -> None:
        if isinstance(params, nn.Module) and readout_constraint is not None:
            raise ValueError("readout_constraint is for parameters with u-μP types: pass "
                             "model.parameters()")
        groups = _groups(params, lr, weight_decay, independent_weight_decay, True,
                         allow_non_unit_scaling_params, rules,
                         lr_scale_func_sgd(readout_constraint))
        super().__init__(groups, lr, *args, **kwargs)
