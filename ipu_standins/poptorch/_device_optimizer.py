"""The optimizer a ``trainingModel`` runs on the device, and PopTorch's and PopART's checks of it.

- :func:`check_ipu_optimizer`: what PopTorch checks when an optimizer is given to
  ``trainingModel`` or ``setOptimizer``;
- :func:`to_ipu_optimizer`: the device-side copy of a PopTorch optimizer or of a torch one
  PopTorch accepts (``torch.optim.SGD``, ``Adam``, ``AdamW``, ``RMSprop``): its own param groups
  over the same parameters, so later changes to the user's optimizer take effect only through
  ``setOptimizer``, as on the IPU; with ``previous``, the device state carries over;
- :func:`check_replacement`: what PopART's ``validReplacement`` refuses when ``setOptimizer``
  replaces a compiled model's optimizer: a constant attribute changed or made variable, another
  optimizer kind, other clipping.
"""
from __future__ import annotations

import collections
import copy
import inspect
import logging
import math
import numbers
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from ._popart_updates import AutoLossScale
from .optim import ACCUM_TYPES, FP16_MAX, LAMB, SGD, Adam, AdamW, Optimizer, RMSprop

__all__ = ["check_ipu_optimizer", "requires_running_mean_reduction", "to_ipu_optimizer",
           "from_torch_optimizer", "check_replacement"]

logger = logging.getLogger("poptorch::python")

# ---- what PopTorch checks when an optimizer is given to trainingModel / setOptimizer ---------

_TYPE_NAMES = ("SGD1", "SGD2", "ADAM", "ADAMW", "ADAMW_NO_BIAS", "RMSPROP", "RMSPROP_CENTERED",
               "LAMB", "LAMB_NO_BIAS")
_UNSUPPORTED = ("Unsupported optimizer type. Types supported "
                + ", ".join("_OptimizerType." + n for n in _TYPE_NAMES))


def _standin_class(optimizer: Any) -> Type[Optimizer]:
    # AdamW first: newer torch makes torch.optim.AdamW a subclass of torch.optim.Adam.
    if isinstance(optimizer, torch.optim.SGD):
        return SGD
    if isinstance(optimizer, torch.optim.AdamW):
        return AdamW
    if isinstance(optimizer, torch.optim.Adam):
        return Adam
    if isinstance(optimizer, torch.optim.RMSprop):
        return RMSprop
    if isinstance(optimizer, LAMB):
        return LAMB
    raise AssertionError(_UNSUPPORTED)


def check_ipu_optimizer(optimizer: Any) -> None:
    """Refuse what PopTorch refuses when the optimizer reaches the device (its
    ``_optimizer_attributes.convertOptimizerToDict`` and the compiler's checks)."""
    cls = _standin_class(optimizer)
    bases = type(optimizer).__bases__
    plain = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop)
    own = (SGD, Adam, AdamW, RMSprop, LAMB)  # PopTorch's own classes are not subclasses
    if torch.optim.Optimizer not in bases and Optimizer not in bases and \
            type(optimizer) not in plain + own:
        logger.warning(
            "Optimizer `%s` subclassed from classes in poptorch.optim or torch.optim are unlikely "
            "to behave as intended. Poptorch does not run Python optimizer code directly; but "
            "instead uses IPU native optimisers implemented in PopART.", type(optimizer).__name__)
    if cls is RMSprop:
        centered = optimizer.param_groups[0]["centered"]
        for i, group in enumerate(optimizer.param_groups):
            if group["centered"] != centered:
                raise AssertionError(
                    "All parameter groups must have the same value for the 'centered' attribute "
                    f"(Group 0: {centered} / Group {i}: {group['centered']})")
    for name in ("accum_type", "velocity_accum_type", "first_order_momentum_accum_type",
                 "second_order_momentum_accum_type"):
        if name in cls._child_only:
            dtype = getattr(optimizer, name, torch.float32)
            if dtype not in ACCUM_TYPES:
                raise ValueError(f"{name} must be set to either torch.float16 or torch.float32 "
                                 f"not {dtype}")
    ls = getattr(optimizer, "loss_scaling", 1.0)
    if not isinstance(ls, numbers.Number):
        raise AssertionError(f"Expected a number for loss_scaling but got {ls} instead")
    for group in [optimizer.defaults] + list(optimizer.param_groups):
        if cls in (Adam, AdamW) and group.get("amsgrad", False):
            raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
        for key in ("lr", "weight_decay", "momentum", "dampening", "eps", "alpha",
                    "velocity_scaling", "max_weight_norm"):
            if key in group and not isinstance(group[key], numbers.Number):
                raise AssertionError(f"Expected a number for {key} but got {group[key]} instead")
        if "betas" in group:
            betas = group["betas"]
            if not (isinstance(betas, tuple) and len(betas) == 2):
                raise AssertionError(f"Expected a pair for betas but got {betas} instead")
    max_norm = getattr(optimizer, "max_grad_norm", float("inf"))
    if isinstance(max_norm, float) and math.isnan(max_norm):
        raise RuntimeError("Maximum norm of gradients cannot be NaN")


def requires_running_mean_reduction(optimizer: Any) -> bool:
    """PopTorch switches ``Training.meanAccumulationAndReplicationReductionStrategy`` to
    ``Running`` when ``accum_type`` is float16 (not for SGD's combined variant); once compiled, an
    optimizer that needs the switch is refused."""
    return (getattr(optimizer, "accum_type", torch.float32) == torch.float16
            and not getattr(optimizer, "use_combined_accum", False))


_GLOBAL_ATTRS = ("loss_scaling", "accum_type", "velocity_accum_type",
                 "first_order_momentum_accum_type", "second_order_momentum_accum_type",
                 "max_grad_norm", "use_combined_accum", "bias_correction", "use_tf_variant",
                 "max_weight_norm")


def to_ipu_optimizer(optimizer: Any, previous: Optional[torch.optim.Optimizer] = None,
                     popart_options: Optional[Dict[str, Any]] = None) -> Any:
    """The device-side optimizer for a PopTorch or plain torch optimizer (see the module's
    docstring). Its param groups are copies over the same parameters; with ``previous`` (the
    device optimizer before ``setOptimizer``) of the same class, the optimizer state carries over
    as it stays on the IPU. ``popart_options`` (``opts._Popart.options``) may enable automatic
    loss scaling (:class:`._popart_updates.AutoLossScale`), whose update factor carries over
    from ``previous`` too. Raises what PopTorch raises for an optimizer it does not accept."""
    check_ipu_optimizer(optimizer)
    groups = [dict(g) for g in optimizer.param_groups]
    for g in groups:
        g["params"] = list(g["params"])
    if isinstance(optimizer, Optimizer):
        dev = copy.copy(optimizer)
        dev.__dict__.pop("state_dict", None)
        dev.__dict__.pop("load_state_dict", None)
        dev.__dict__["_ipu_param_overrides"] = {}
        dev.param_groups = groups  # type: ignore[attr-defined]
        dev.defaults = dict(optimizer.defaults)  # type: ignore[attr-defined]
        dev.state = collections.defaultdict(dict)  # type: ignore[attr-defined]
        dev.variable_attrs = copy.deepcopy(optimizer.variable_attrs)  # type: ignore
    else:
        dev = from_torch_optimizer(optimizer)
    # Before the replacement is checked: automatic loss scaling makes the new optimizer's loss
    # scaling variable, as it made the compiled one's.
    _attach_auto_loss_scale(dev, previous, popart_options or {})
    if previous is not None:
        check_replacement(previous, dev)
    if previous is not None and type(previous) is type(dev):
        dev.state = previous.state  # type: ignore[attr-defined]
        if _snapshot(previous) == _snapshot(dev):
            # PopTorch sends nothing when the optimizer is unchanged: values written with
            # load_ipu_state_dict stay on the device.
            dev.__dict__["_ipu_param_overrides"] = previous._overrides()  # type: ignore
    return dev


def _attach_auto_loss_scale(dev: Any, previous: Any, popart: Dict[str, Any]) -> None:
    """Automatic loss scaling: the update factor is a variable of the graph, kept when the
    optimizer is replaced. PopTorch makes the loss scaling a variable then
    (``_optimizer_attributes.py``); PopART needs float16 gradients to track."""
    als = previous.auto_loss_scale() if previous is not None else None
    if als is None:
        als = AutoLossScale.from_options(popart)
    if als is None:
        return
    params = [p for g in dev.param_groups for p in g["params"] if p.requires_grad]
    if not any(p.dtype == torch.float16 for p in params):
        raise RuntimeError("Automatic loss scaling tracks float16 gradients, and no weight the "
                           "optimizer trains is float16 (use a loss scale of your own instead)")
    dev.__dict__["_auto_loss_scale"] = als
    va = getattr(dev, "variable_attrs", None)
    if va is not None:
        va.markAsVariable("loss_scaling")


def _snapshot(opt: Any) -> Tuple[Any, ...]:
    groups = [sorted((k, repr(v)) for k, v in g.items() if k != "params")
              for g in opt.param_groups]
    attrs = [(a, repr(getattr(opt, a, None))) for a in _GLOBAL_ATTRS]
    return (type(opt).__name__, repr(groups), tuple(attrs))


def from_torch_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    """The stand-in optimizer equivalent to a plain ``torch.optim.SGD``, ``Adam``, ``AdamW`` or
    ``RMSprop`` (PopTorch's defaults for what torch lacks: no loss scaling, float32 accumulators,
    separate SGD variant). Its attributes count as constants where they equal torch's defaults,
    as PopTorch treats a torch optimizer's."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    cls = _standin_class(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    groups = [dict(g) for g in optimizer.param_groups]
    for g in groups:
        g["params"] = list(g["params"])
    kwargs = {k: v for k, v in optimizer.defaults.items()
              if k in accepted and k not in ("params", "self") and v is not None}
    dev = cls(groups, **kwargs)  # type: ignore[call-arg]
    dev.variable_attrs = None  # type: ignore[attr-defined]
    dev.state = collections.defaultdict(dict)  # type: ignore[attr-defined]
    for k in optimizer.defaults:
        dev.defaults.setdefault(k, optimizer.defaults[k])  # type: ignore[attr-defined]
    return dev


# ---- PopART's check when setOptimizer replaces the optimizer of a compiled model ------------

def _popart_error(message: str) -> Exception:
    try:
        from .poptorch_core import Error
    except ImportError:  # pragma: no cover - the stand-in always has it
        return RuntimeError(message)
    err = Error(message)
    err.type = "popart_exception"
    return err


def _popart_kind(opt: Any) -> Tuple[str, str, str]:
    """(PopART optimizer type, Adam mode, weight decay mode)."""
    if isinstance(opt, SGD):
        return ("SGD", "", "")
    if isinstance(opt, RMSprop):
        return ("Adaptive", "", "L2Regularization")
    if isinstance(opt, LAMB):
        return ("Adam", "Lamb" if opt.bias_correction else "LambNoBias", "Decay")
    return ("Adam", "Adam", "L2Regularization" if isinstance(opt, Adam) else "Decay")


def _const_rule(opt: Any, attr: str, value: Any) -> bool:
    """PopTorch's constness of an attribute (``_optimizer_attributes``): the optimizer's
    ``variable_attrs`` if it has them (PopTorch's optimizers), else by value (torch's)."""
    va = getattr(opt, "variable_attrs", None)
    if va is not None:
        return bool(va.isConstant(attr))
    if attr == "lr":
        return False
    if attr in ("betas", "alpha", "nesterov"):
        return True
    defaults = {"weight_decay": 1e-2 if isinstance(opt, AdamW) else 0.0, "momentum": 0.0,
                "velocity_scaling": 1.0, "eps": 1e-8, "max_weight_norm": FP16_MAX,
                "loss_scaling": 1.0}
    return bool(value == defaults[attr])


def _replacement_values(opt: Any) -> Dict[str, Dict[Any, Tuple[float, bool]]]:
    """PopART's OptimizerValueMaps: label -> {"default" or weight: (value, is_const)}, a weight
    by its position among the optimizer's parameters (the executor maps the new optimizer's
    parameters to the device's after this check)."""
    attrs: List[Tuple[str, str, Optional[int]]]
    if isinstance(opt, SGD):
        attrs = [("learning rates", "lr", None), ("weight decays", "weight_decay", None),
                 ("momentums", "momentum", None), ("nesterov", "nesterov", None)]
        if opt.use_combined_accum:
            attrs.append(("velocity scalings", "velocity_scaling", None))
    elif isinstance(opt, RMSprop):
        attrs = [("learning rates", "lr", None), ("weight decays", "weight_decay", None),
                 ("alphas", "alpha", None), ("momentums", "momentum", None),
                 ("eps", "eps", None)]
    else:
        attrs = [("learning rates", "lr", None), ("weight decays", "weight_decay", None),
                 ("beta1s", "betas", 0), ("beta2s", "betas", 1), ("eps", "eps", None)]
        if isinstance(opt, LAMB):
            attrs.append(("mwn", "max_weight_norm", None))
    out: Dict[str, Dict[Any, Tuple[float, bool]]] = {}
    sources: List[Tuple[Any, Dict[str, Any]]] = [("default", opt.defaults)]
    sources += [(i, g) for i, (g, _p) in enumerate(
        (g, p) for g in opt.param_groups for p in g["params"])]
    for label, attr, index in attrs:
        values: Dict[Any, Tuple[float, bool]] = {}
        for key, group in sources:
            value = group.get(attr, 1.0 if attr == "velocity_scaling" else None)
            if value is None:
                continue
            const = _const_rule(opt, attr, value)
            values[key] = (float(value[index] if index is not None else value), const)
        out[label] = values
    ls = float(opt.loss_scaling)
    out["loss scaling"] = {"default": (ls, _const_rule(opt, "loss_scaling", ls))}
    return out


def _replace_value(old: Tuple[float, bool], new: Tuple[float, bool]) -> None:
    if old[1] != new[1]:
        raise ValueError("Can not replace a constant value with a non constant value.")
    if old[1] and old[0] != new[0]:
        raise ValueError("Values are constant but do not match.")


def check_replacement(previous: Any, new: Any) -> None:
    """Refuse, as PopART's ``Optimizer::validReplacement`` does, a new optimizer for a compiled
    model that changes a constant attribute, makes a constant variable (or the reverse), changes
    the optimizer's kind, its gradient clipping, or whether SGD keeps a velocity."""
    old_kind, new_kind = _popart_kind(previous), _popart_kind(new)
    old_norm = float(getattr(previous, "max_grad_norm", float("inf")))
    new_norm = float(getattr(new, "max_grad_norm", float("inf")))
    if math.isinf(old_norm) != math.isinf(new_norm):
        raise _popart_error("Clip norm settings do not match.")
    if not math.isinf(old_norm) and old_norm != new_norm:
        raise _popart_error("Clip norm settings at index 0 do not match.")
    if old_kind[0] != new_kind[0]:
        raise _popart_error(f"Can not replace optimizer of type {old_kind[0]} with new "
                            f"optimizer of type {new_kind[0]}")
    if old_kind[1] != new_kind[1]:
        raise _popart_error("Adam modes do not match")
    if old_kind[2] != new_kind[2]:
        raise _popart_error("Weight decay modes do not match")
    old_vals, new_vals = _replacement_values(previous), _replacement_values(new)
    for label in ["loss scaling"] + [k for k in old_vals if k != "loss scaling"]:
        before, after = old_vals[label], new_vals.get(label, {})
        try:
            if "default" in before and "default" in after:
                try:
                    _replace_value(before["default"], after["default"])
                except ValueError as err:
                    if label == "loss scaling":
                        raise
                    raise ValueError(
                        f"Default value is not a valid replacement. {err}") from err
            specific_before = {k: v for k, v in before.items() if k != "default"}
            specific_after = {k: v for k, v in after.items() if k != "default"}
            if len(specific_before) != len(specific_after):
                raise ValueError("Replacement OptimizerValueMap has a different number of "
                                 "specific tensors.")
            for key, value in specific_before.items():
                if key not in specific_after:
                    raise ValueError("Could not find tensor in replacement OptimizerValueMap.")
                try:
                    _replace_value(value, specific_after[key])
                except ValueError as err:
                    raise ValueError(f"OptimizerValue for tensor {key} is not a valid "
                                     f"replacement.{err}") from err
        except ValueError as err:
            raise _popart_error(f"Problem with {label}. {err}") from None
    if isinstance(previous, SGD) and isinstance(new, SGD):
        def has_velocity(opt: SGD) -> bool:
            return not _const_rule(opt, "momentum", opt.defaults["momentum"]) or \
                opt.defaults["momentum"] != 0.0
        if has_velocity(previous) != has_velocity(new):
            raise _popart_error("this does not require a velocity tensor, but other does.")
        if has_velocity(previous):
            if previous.use_combined_accum != new.use_combined_accum:
                names = {True: "Combined", False: "Separate"}
                raise _popart_error(
                    f"this has SGDAccumulatorAndMomentum {names[previous.use_combined_accum]}, "
                    f"but other has {names[new.use_combined_accum]}")
            if not previous.use_combined_accum:
                for attr, popart in (("accum_type", "sgdAccumType"),
                                     ("velocity_accum_type", "sgd2Accl1Type")):
                    if getattr(previous, attr) != getattr(new, attr):
                        raise _popart_error(
                            f"this has SGDAccumulatorAndMomentum::Separate and {popart} "
                            f"{getattr(previous, attr)}, but other has {getattr(new, attr)}")
