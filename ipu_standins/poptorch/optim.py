"""``poptorch.optim`` for the PopTorch stand-in: PopTorch's optimizers with PopART's update rules.

The classes keep PopTorch's constructor arguments, defaults and checks (``loss_scaling``,
``accum_type``, ``velocity_accum_type``, ``first_order_momentum_accum_type``,
``second_order_momentum_accum_type``, ``velocity_scaling``, ``use_combined_accum``,
``max_grad_norm``, ``bias_correction``, ``max_weight_norm``, ``use_tf_variant``), and subclass the
torch optimizer PopTorch subclasses, so ``isinstance(opt, torch.optim.SGD)``, ``param_groups``,
``state_dict()`` and learning-rate schedulers work as with PopTorch. ``variable_attrs`` records
which attributes the user set (PopTorch sends those to the device as variables, the others as
constants).

Where PopTorch hands the optimizer to PopART, which runs it on the IPU, the stand-in runs
``step()`` here, following PopART's update rules (``willow/include/popart/sgd.hpp``, ``adam.hpp``,
``adaptive.hpp``) in the dtypes PopART keeps:

* The gradient is divided by ``loss_scaling`` inside ``step()``.
* Optimizer state is kept in the accumulator types, float32 by default even for float16
  weights. If ``accum_type`` is float16 and both momentum types are float32, the gradient is cast
  to float32 before it is unscaled (PopART's ``gradCast``); otherwise it is unscaled in its own
  dtype (so float16 weights with the default float32 ``accum_type`` unscale in float16).
* ``Adam`` applies weight decay as L2 regularisation (added to the gradient); ``AdamW`` and ``LAMB``
  decay the weight (``u = m/(sqrt(v)+eps) + wd*w``). PopTorch c2a8b17 maps
  ``AdamW(bias_correction=False)`` to PopART's bias-corrected Adam mode (only ``LAMB`` honours
  ``bias_correction=False``), and so does the stand-in.
* The Adam updater computes ``m_hat`` in the first-moment dtype and ``sqrt(v_hat) + eps`` in the
  second-moment dtype, as PopART's ``AdamUpdaterOpx`` does; with a float16 second moment ``eps =
  1e-8`` rounds to 0 there as well.
* ``LAMB`` scales the step by ``min(||w||, max_weight_norm) / ||u||`` (1 when either norm is 0),
  norms in float32.
* ``SGD`` without momentum: ``w = w * (1 - lr(1-dm)wd) - lr(1-dm)/ls * g`` (PopART's SGD0: the
  dampening applies even without momentum, unlike torch). With momentum, the separate variant
  (default) keeps the velocity scaled by the loss scaling (PopTorch sets the velocity scaling to
  the loss scaling) in ``velocity_accum_type``; the combined variant
  (``use_combined_accum=True``) keeps it scaled by ``velocity_scaling`` in the weight's dtype. The
  first velocity is ``(1-dm)(g + wd*w)`` (torch uses ``g + wd*w``; PopART dampens every step, see
  :class:`._popart_updates.SGDRule`); the rest is torch's rule.
* ``RMSprop`` follows PopART's ``Adaptive``: L2 weight decay; ``first_order_momentum_accum_type``
  is the dtype of the mean square, ``second_order_momentum_accum_type`` of the centred mean, the
  momentum buffer is float32; ``use_tf_variant=True`` starts the mean square at one, takes ``eps``
  inside the square root and folds the learning rate into the momentum.
* ``max_grad_norm`` clips as PopART's ``ClipWeightGradientsByNorm``: factor ``max_norm /
  max(max_norm, global_norm)`` over the optimizer's weights, applied to the gradient entering the
  moments (Adam, AdamW, LAMB) or to the term that updates the weight (SGD: the loss-scaled gradient
  without momentum, the velocity with it).
* ``maximize`` is accepted and ignored, as PopART has no such mode.

The update rules are in :mod:`._popart_updates`, the device-side copy of an optimizer and the
checks of PopTorch and PopART in :mod:`._device_optimizer`, and the device state as PopTorch reads
and writes it in :mod:`._optimizer_state`. Contract with the stand-in's executor (one optimizer
step of a ``trainingModel``)::

    ipu_opt = to_ipu_optimizer(user_optimizer)       # trainingModel(): PopTorch's checks
    (loss * ipu_opt.loss_scaling).backward()         # p.grad: sum (or mean) over micro-batches
    ipu_opt.step()                                   # unscale, clip, update in PopART's dtypes
    ipu_opt.zero_grad()
    ipu_opt = to_ipu_optimizer(new_opt, previous=ipu_opt)   # setOptimizer: the state stays

Automatic loss scaling (``opts.Training.setAutomaticLossScaling(True)``) is PopART's: see
:class:`._popart_updates.AutoLossScale`; the update divides by the loss scaling times its update
factor.

Not modelled: the gradient accumulator's dtype over micro-batches (``accum_type`` with gradient
accumulation: the executor sums micro-batch gradients in the weight's dtype), the running mean
reduction's rounding and replica sharding of the optimizer state.

Calling ``step()`` of a PopTorch optimizer directly (on the host, outside a ``trainingModel``) also
divides by ``loss_scaling``, where PopTorch would run torch's rule on the unscaled gradient.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ._popart_updates import AdamRule, DeviceUpdate, RMSpropRule, SGDRule

__all__ = [
    "VariableAttributes",
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "LAMB",
    "ACCUM_TYPES",
    "FP16_MAX",
]

logger = logging.getLogger("poptorch::python")

ACCUM_TYPES = (torch.float16, torch.float32)  # what PopTorch's accumulator types may be
_ACCUM_ERROR = "Accumulation types must be either torch.float32 or torch.float16"
FP16_MAX = 65500.0  # LAMB's default max_weight_norm, the float16 maximum


class VariableAttributes:
    """Which optimizer attributes PopTorch sends to the device as variables (the ones the user
    set explicitly) and which as constants. ``opt.variable_attrs`` of every PopTorch optimizer."""

    def __init__(self, variable_attributes: List[str], allowed_attributes: List[str]) -> None:
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:
        """True if ``attr`` is treated as a constant."""
        return attr not in self._variable_attributes

    def _check(self, attr: str) -> None:
        if attr not in self._allowed_attributes:
            raise AssertionError(
                f"Unknown attribute {attr}, allowed values: {self._allowed_attributes}")

    def markAsConstant(self, attr: str) -> None:
        """Treat ``attr`` as a constant."""
        self._check(attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:
        """Treat ``attr`` as a variable (it can then change without recompiling)."""
        self._check(attr)
        if attr not in self._variable_attributes:
            self._variable_attributes.append(attr)


def _explicit(args: Dict[str, Any]) -> List[str]:
    """The argument names the user set (PopTorch: those are variables)."""
    return [k for k, v in args.items() if v is not None and k not in ("self", "params")]


def _parent_kwargs(parent: type, args: Dict[str, Any], child_only: List[str]) -> Dict[str, Any]:
    """The arguments to forward to the torch parent: set, not PopTorch-only, and known to the
    installed torch (PopTorch's signatures follow torch 2.0.1's)."""
    accepted = inspect.signature(parent).parameters
    return {k: v for k, v in args.items()
            if k not in ("self", "params") and k not in child_only and v is not None
            and k in accepted}


def _check_accum_type(dtype: Any) -> None:
    if dtype not in ACCUM_TYPES:
        raise AssertionError(_ACCUM_ERROR)


class Optimizer(DeviceUpdate):
    """Base of PopTorch's optimizers: the host copy of the device state (``ipu_state`` and
    ``ipu_param``) next to torch's own state dict."""

    _child_vars: List[str] = ["loss_scaling"]
    _child_only: List[str] = []
    _group_vars: List[str] = []
    loss_scaling: float = 1.0
    max_grad_norm: float = float("inf")
    accum_type: torch.dtype = torch.float32
    first_order_momentum_accum_type: torch.dtype = torch.float32
    second_order_momentum_accum_type: torch.dtype = torch.float32

    def __init__(self) -> None:
        self._state_dict: Dict[str, Any] = {"ipu_state": None, "ipu_param": None}
        self.ipu_state_is_dirty = False
        self.host_state_is_dirty = False

    # PopTorch's executor replaces state_dict on the instance once the model is compiled.
    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.get_state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # type: ignore[override]
        torch.optim.Optimizer.load_state_dict(self, state)  # type: ignore[arg-type]
        self.set_state_dict(state)

    def get_state_dict(self) -> Dict[str, Any]:
        return {**self._state_dict,
                **torch.optim.Optimizer.state_dict(self)}  # type: ignore[arg-type]

    def set_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        if not ("ipu_state" in state and "ipu_param" in state):
            raise RuntimeError("Only IPU optimizer states can be loaded onto the IPU.")
        self._state_dict = state
        self.ipu_state_is_dirty = True
        self.host_state_is_dirty = False

    def has_state(self) -> bool:
        return (self._state_dict.get("ipu_state") is not None
                and self._state_dict.get("ipu_param") is not None)

    # Pickling and copy.copy keep PopTorch's attributes (torch's __getstate__ keeps only
    # defaults, state and param_groups).
    def __getstate__(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("state_dict", "load_state_dict")}
        state["ipu_state_is_dirty"] = self.has_state()
        state["host_state_is_dirty"] = False
        return state


def _init_accum_types(opt: Any, accum_type: Optional[torch.dtype],
                      first: Optional[torch.dtype], second: Optional[torch.dtype]) -> None:
    accum_type = torch.float32 if accum_type is None else accum_type
    first = torch.float32 if first is None else first
    second = torch.float32 if second is None else second
    _check_accum_type(accum_type)
    opt.accum_type = accum_type
    _check_accum_type(first)
    opt.first_order_momentum_accum_type = first
    _check_accum_type(second)
    opt.second_order_momentum_accum_type = second


class SGD(SGDRule, Optimizer, torch.optim.SGD):
    """PopTorch's SGD with optional momentum, loss scaling and velocity scaling.

    ``use_combined_accum=False`` (default): separate gradient accumulator (``accum_type``) and
    velocity (``velocity_accum_type``); the velocity scaling is the loss scaling and a given
    ``velocity_scaling`` is ignored with a warning. ``use_combined_accum=True``: one tensor, in the
    weight's dtype, scaled by ``velocity_scaling`` (a group attribute)."""

    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["velocity_scaling", "use_combined_accum", "accum_type",
                                 "velocity_accum_type", "max_grad_norm"]
    _group_vars = ["lr", "momentum", "dampening", "weight_decay", "nesterov", "velocity_scaling"]

    def __init__(self,
                 params: Iterable,
                 lr: float,
                 momentum: Optional[float] = None,
                 dampening: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 nesterov: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 velocity_scaling: Optional[float] = None,
                 use_combined_accum: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 velocity_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        args = dict(locals())
        variables = _explicit(args)
        Optimizer.__init__(self)
        torch.optim.SGD.__init__(self, params,
                                 **_parent_kwargs(torch.optim.SGD, args, SGD._child_only))
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.use_combined_accum = bool(use_combined_accum)
        if velocity_scaling is None:
            velocity_scaling = 1.0
        elif not self.use_combined_accum:
            logger.warning("velocity_scaling value ignored when using the separate variant "
                           "(use_combined_accum=False). In future, this will lead to an error. "
                           "Please update your code.")
        if self.use_combined_accum:
            self.defaults["velocity_scaling"] = velocity_scaling
            for group in self.param_groups:
                group.setdefault("velocity_scaling", velocity_scaling)
        accum_type = torch.float32 if accum_type is None else accum_type
        velocity_accum_type = torch.float32 if velocity_accum_type is None else velocity_accum_type
        _check_accum_type(accum_type)
        self.accum_type = accum_type
        _check_accum_type(velocity_accum_type)
        self.velocity_accum_type = velocity_accum_type
        self.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + SGD._child_vars)


class Adam(AdamRule, Optimizer, torch.optim.Adam):
    """PopTorch's Adam (weight decay as L2 regularisation), with loss scaling and accumulator
    types. AMSGrad is refused when the model is built, as PopTorch does."""

    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["accum_type", "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type", "max_grad_norm"]
    _group_vars = ["lr", "betas", "eps", "weight_decay", "amsgrad"]
    _l2_decay = True

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 amsgrad: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 capturable: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        args = dict(locals())
        variables = _explicit(args)
        Optimizer.__init__(self)
        torch.optim.Adam.__init__(self, params,
                                  **_parent_kwargs(torch.optim.Adam, args, Adam._child_only))
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        _init_accum_types(self, accum_type, first_order_momentum_accum_type,
                          second_order_momentum_accum_type)
        self.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + Adam._child_vars)


class AdamW(AdamRule, Optimizer, torch.optim.AdamW):
    """PopTorch's AdamW (decoupled weight decay), with loss scaling and accumulator types."""

    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["bias_correction", "accum_type",
                                 "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type", "max_grad_norm"]
    _group_vars = ["lr", "betas", "weight_decay", "eps", "amsgrad"]

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 amsgrad: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 capturable: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        args = dict(locals())
        variables = _explicit(args)
        Optimizer.__init__(self)
        torch.optim.AdamW.__init__(self, params,
                                   **_parent_kwargs(torch.optim.AdamW, args, AdamW._child_only))
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.bias_correction = True if bias_correction is None else bias_correction
        _init_accum_types(self, accum_type, first_order_momentum_accum_type,
                          second_order_momentum_accum_type)
        self.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + AdamW._child_vars)

    def _bias_corrected(self) -> bool:
        # PopTorch c2a8b17 (CompilerImpl.cpp) gives ADAMW_NO_BIAS PopART's AdamMode::Adam.
        return True


class RMSprop(RMSpropRule, Optimizer, torch.optim.RMSprop):
    """PopTorch's RMSprop (PopART's Adaptive RMSProp / CenteredRMSProp, L2 weight decay), with
    loss scaling, accumulator types and the TensorFlow variant."""

    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["accum_type", "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type", "use_tf_variant"]
    _group_vars = ["lr", "momentum", "weight_decay", "alpha", "eps", "centered"]

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 alpha: Optional[float] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 momentum: Optional[float] = None,
                 centered: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 use_tf_variant: Optional[bool] = None) -> None:
        args = dict(locals())
        variables = _explicit(args)
        Optimizer.__init__(self)
        torch.optim.RMSprop.__init__(
            self, params, **_parent_kwargs(torch.optim.RMSprop, args, RMSprop._child_only))
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        _init_accum_types(self, accum_type, first_order_momentum_accum_type,
                          second_order_momentum_accum_type)
        self.use_tf_variant = False if use_tf_variant is None else use_tf_variant
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + RMSprop._child_vars)


class LAMB(AdamRule, Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (LAMB), PopTorch's arguments and defaults: the step of each
    weight is scaled by ``min(||w||, max_weight_norm) / ||u||`` (``max_weight_norm=None`` means
    65500, the float16 maximum)."""

    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["bias_correction", "accum_type",
                                 "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type"]
    _group_vars = ["lr", "weight_decay", "betas", "eps", "max_weight_norm"]
    _lamb = True

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 max_weight_norm: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None) -> None:
        variables = _explicit(dict(locals()))
        defaults = dict(lr=1e-3 if lr is None else lr,
                        betas=(0.9, 0.999) if betas is None else betas,
                        eps=1e-8 if eps is None else eps,
                        weight_decay=1e-2 if weight_decay is None else weight_decay,
                        max_weight_norm=FP16_MAX if max_weight_norm is None else max_weight_norm)
        Optimizer.__init__(self)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.bias_correction = True if bias_correction is None else bias_correction
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.max_weight_norm = defaults["max_weight_norm"]
        _init_accum_types(self, accum_type, first_order_momentum_accum_type,
                          second_order_momentum_accum_type)
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + LAMB._child_vars)

    def _bias_corrected(self) -> bool:
        return bool(self.bias_correction)


