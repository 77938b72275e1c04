"""``poptorch.optim`` for the PopTorch stand-in: PopTorch's optimizers with PopART's update rules.

Over 600 lines because it is one module in PopTorch (``poptorch.optim``): five optimizers with
PopTorch's argument checks, PopART's update rules and its device-state names.

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
  first velocity is ``(1-dm)(g + wd*w)`` (torch uses ``g + wd*w``); the rest is torch's rule.
* ``RMSprop`` follows PopART's ``Adaptive``: L2 weight decay; ``first_order_momentum_accum_type``
  is the dtype of the mean square, ``second_order_momentum_accum_type`` of the centred mean, the
  momentum buffer is float32; ``use_tf_variant=True`` starts the mean square at one, takes ``eps``
  inside the square root and folds the learning rate into the momentum.
* ``max_grad_norm`` clips as PopART's ``ClipWeightGradientsByNorm``: factor ``max_norm /
  max(max_norm, global_norm)`` over the optimizer's weights, applied to the gradient entering the
  moments (Adam, AdamW, LAMB) or to the term that updates the weight (SGD: the loss-scaled gradient
  without momentum, the velocity with it).
* ``maximize`` is accepted and ignored, as PopART has no such mode.

Contract with the stand-in's executor (one optimizer step of a ``trainingModel``)::

    ipu_opt = to_ipu_optimizer(user_optimizer)       # trainingModel(): PopTorch's checks
    (loss * ipu_opt.loss_scaling).backward()         # p.grad: sum (or mean) over micro-batches
    ipu_opt.step()                                   # unscale, clip, update in PopART's dtypes
    ipu_opt.zero_grad()
    ipu_opt = to_ipu_optimizer(new_opt, previous=ipu_opt)   # setOptimizer: the state stays

``to_ipu_optimizer`` accepts PopTorch's optimizers and the plain torch ones PopTorch accepts
(``torch.optim.SGD``, ``Adam``, ``AdamW``, ``RMSprop``) and returns the device-side copy: its own
param groups over the same parameters, so later changes to the user's optimizer take effect only
through ``setOptimizer``, as on the IPU. ``ipu_state_dict`` and ``load_ipu_state_dict`` give and set
the ``{"ipu_state", "ipu_param"}`` dictionaries PopTorch reads from and writes to the device, with
PopART's tensor names (``Accl1___lin.weight``, ``learningRate___specific___lin.bias``,
``lossScaling_FLOAT``...), and ``attach_ipu_state`` / ``sync_ipu_state`` / ``detach_ipu_state`` give
a PopTorch optimizer PopTorch's ``state_dict()`` protocol (read back from the device when it has run
since, written to it before the next run after ``load_state_dict``).

``check_replacement`` (called by ``to_ipu_optimizer`` with ``previous``) refuses what PopART's
``validReplacement`` refuses when ``setOptimizer`` replaces a compiled model's optimizer: a constant
attribute changed or made variable, another optimizer kind, other clipping. ``popart_optimizer_ops``
lists the optimizer ops PopART's IR holds per weight (``SGD0VarUpdate``, ``AdamUpdater``...).

Not modelled: the gradient accumulator's dtype over micro-batches (``accum_type`` with gradient
accumulation: the executor sums micro-batch gradients in the weight's dtype), the running mean
reduction's rounding, automatic loss scaling and replica sharding of the optimizer state.

Calling ``step()`` of a PopTorch optimizer directly (on the host, outside a ``trainingModel``) also
divides by ``loss_scaling``, where PopTorch would run torch's rule on the unscaled gradient.
"""

from __future__ import annotations

import collections
import copy
import inspect
import logging
import math
import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Type

import torch

__all__ = [
    "VariableAttributes",
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "LAMB",
    "to_ipu_optimizer",
    "from_torch_optimizer",
    "check_ipu_optimizer",
    "requires_running_mean_reduction",
    "ipu_state_dict",
    "load_ipu_state_dict",
    "attach_ipu_state",
    "detach_ipu_state",
    "sync_ipu_state",
    "popart_optimizer_ops",
    "check_replacement",
]

logger = logging.getLogger("poptorch::python")

_ACCUM_TYPES = (torch.float16, torch.float32)
_ACCUM_ERROR = "Accumulation types must be either torch.float32 or torch.float16"
_FP16_MAX = 65500.0


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
    if dtype not in _ACCUM_TYPES:
        raise AssertionError(_ACCUM_ERROR)


class Optimizer:
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

    # ---- the device side: PopART's update, run here -------------------------------------------

    def _overrides(self) -> Dict[Tuple[int, str], torch.Tensor]:
        ov = self.__dict__.get("_ipu_param_overrides")
        if ov is None:
            ov = {}
            self.__dict__["_ipu_param_overrides"] = ov
        return ov

    def _scalar(self, p: torch.Tensor, name: str, value: float) -> float:
        """A hyperparameter for weight ``p``, or the value written with load_ipu_state_dict."""
        ov = self._overrides().get((id(p), name))
        return float(ov) if ov is not None else float(value)

    def _loss_scaling(self) -> float:
        ov = self._overrides().get((0, "lossScaling"))
        return float(ov) if ov is not None else float(self.loss_scaling)

    def _params_with_grad(self) -> List[Tuple[Dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"]  # type: ignore[attr-defined]
                if p.grad is not None]

    def _clip_factor(self, tensors: List[torch.Tensor]) -> Optional[float]:
        """PopART's ClipWeightGradientsByNorm: max_norm / max(max_norm, global_norm)."""
        max_norm = float(getattr(self, "max_grad_norm", float("inf")))
        if math.isnan(max_norm):
            raise RuntimeError("Maximum norm of gradients cannot be NaN")
        if math.isinf(max_norm) or not tensors:
            return None
        total = torch.zeros((), dtype=torch.float32)
        for t in tensors:
            total = total + t.float().pow(2).sum()
        norm = float(total.sqrt())
        return max_norm / max(max_norm, norm)

    def _grad_into_moments(self, p: torch.Tensor, ls: float) -> torch.Tensor:
        """The gradient as PopART feeds the moments: cast to float32 if accum_type is float16 and
        both moments are float32 (gradCast), then divided by the loss scaling in its dtype."""
        g = p.grad
        assert g is not None
        accum = getattr(self, "accum_type", torch.float32)
        m1 = getattr(self, "first_order_momentum_accum_type", torch.float32)
        m2 = getattr(self, "second_order_momentum_accum_type", torch.float32)
        if accum == torch.float16 and m1 == torch.float32 and m2 == torch.float32:
            g = g.float()
        return g * (1.0 / ls) if ls != 1.0 else g.clone()


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """Square root in ``t``'s dtype (float16 through float32, which rounds it correctly: torch
    2.0.1 has no float16 sqrt on the CPU)."""
    return t.float().sqrt().to(t.dtype)


def _update_weight(p: torch.Tensor, update: torch.Tensor, scale: float) -> None:
    """``p += scale * update``, computed in float32 and rounded once to the weight's dtype."""
    p.copy_((p.float() + scale * update.float()).to(p.dtype))


class _AdamBase(Optimizer):
    """PopART's Adam/AdamW/Lamb rule (``adam.hpp``, ``AdamUpdaterOpx``, ``AdamVarUpdateOpx``)."""

    _l2_decay = False  # Adam: weight decay as L2 regularisation
    _lamb = False

    def _bias_corrected(self) -> bool:
        return True

    def _moment_state(self, p: torch.Tensor) -> Dict[str, Any]:
        state = self.state[p]  # type: ignore[attr-defined]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # PopART: FP32 counter
            state["exp_avg"] = torch.zeros_like(
                p, dtype=getattr(self, "first_order_momentum_accum_type", torch.float32),
                memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(
                p, dtype=getattr(self, "second_order_momentum_accum_type", torch.float32),
                memory_format=torch.preserve_format)
        return state

    def _init_device_state(self) -> None:
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                self._moment_state(p)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ls = self._loss_scaling()
        items = self._params_with_grad()
        grads = []
        for group, p in items:
            g = self._grad_into_moments(p, ls)
            if self._l2_decay:
                wd = self._scalar(p, "weightDecay", group["weight_decay"])
                if wd != 0.0:
                    g = g + wd * p.to(g.dtype)
            grads.append(g)
        factor = self._clip_factor(grads)
        for (group, p), g in zip(items, grads):
            if factor is not None:
                g = g * factor
            self._adam_update(group, p, g)
        return loss

    def _adam_update(self, group: Dict[str, Any], p: torch.Tensor, g: torch.Tensor) -> None:
        state = self._moment_state(p)
        beta1 = self._scalar(p, "beta1", group["betas"][0])
        beta2 = self._scalar(p, "beta2", group["betas"][1])
        eps = self._scalar(p, "eps", group["eps"])
        lr = self._scalar(p, "learningRate", group["lr"])
        wd = self._scalar(p, "weightDecay", group["weight_decay"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # Moments, each in its own dtype.
        m.mul_(beta1).add_(g.to(m.dtype), alpha=1.0 - beta1)
        g2 = g.to(v.dtype)
        v.mul_(beta2).add_(g2 * g2, alpha=1.0 - beta2)
        state["step"] += 1.0
        t = float(state["step"])
        if self._bias_corrected():
            c1 = torch.tensor(1.0 - beta1 ** t, dtype=torch.float32).to(m.dtype)
            c2 = torch.tensor(1.0 - beta2 ** t, dtype=torch.float32).to(v.dtype)
            m_hat = m / c1
            v_hat = _sqrt(v / c2)
        else:
            m_hat = m.clone()
            v_hat = _sqrt(v)
        eps_t = torch.tensor(eps, dtype=torch.float32).to(v.dtype)
        upd = m_hat.to(v.dtype) / (v_hat + eps_t)
        if not self._l2_decay and wd != 0.0:
            upd = upd.to(p.dtype) + wd * p
        else:
            upd = upd.to(m.dtype)
        scale = lr
        if self._lamb:
            mwn = self._scalar(p, "maxWeightNorm", group["max_weight_norm"])
            if mwn != 0.0:
                r1 = float(p.float().pow(2).sum().sqrt())
                r2 = float(upd.float().pow(2).sum().sqrt())
                if r1 != 0.0 and r2 != 0.0:
                    scale = lr * min(r1, mwn) / r2
        _update_weight(p, upd, -scale)


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


class SGD(Optimizer, torch.optim.SGD):
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

    # ---- PopART's SGD0 / SGD1 (combined) / SGD2 (separate) ------------------------------------

    def _with_velocity(self, group: Dict[str, Any]) -> bool:
        """PopART keeps a velocity when the momentum is non-zero or a variable."""
        va = getattr(self, "variable_attrs", None)
        return group["momentum"] != 0.0 or (va is not None and not va.isConstant("momentum"))

    def _sgd_scalars(self, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, float]:
        """PopART's compound scalars for weight ``p`` (sgd.hpp), by their tensor names."""
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        mm, dm = float(group["momentum"]), float(group["dampening"])
        ls = self._loss_scaling()
        if not self._with_velocity(group):
            names = {"scaledLearningRate0": lr * (1.0 - dm) / ls,
                     "weightDecayScaleFactor0": 1.0 - lr * (1.0 - dm) * wd}
        else:
            vs = float(group.get("velocity_scaling", 1.0)) if self.use_combined_accum else ls
            k = "1" if self.use_combined_accum else "2"
            names = {"scaledLearningRate" + k: lr / vs,
                     "scaledWeightDecay1": (1.0 - dm) * wd * vs,
                     "dampeningScaleFactor" + k: (1.0 - dm) * vs / ls,
                     "scaledMomentum" + k: mm}
            if group.get("nesterov", False):
                names["nesterovGradScaleFactor" + k] = vs
                names["sgdWeightDecay"] = wd
                names["sgdMomentum"] = mm
        return {n: self._scalar(p, n, v) for n, v in names.items()}

    def _velocity(self, p: torch.Tensor, group: Dict[str, Any]) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state or state["momentum_buffer"] is None:
            dtype = p.dtype if self.use_combined_accum else self.velocity_accum_type
            buf = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if self.use_combined_accum:
                # Combined: the weight-decay term of the first step is added up front.
                s = self._sgd_scalars(p, group)
                buf.add_((s["scaledWeightDecay1"] * p.float()).to(dtype))
            state["momentum_buffer"] = buf
        return state["momentum_buffer"]

    def _init_device_state(self) -> None:
        for group in self.param_groups:
            if self._with_velocity(group):
                for p in group["params"]:
                    self._velocity(p, group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = self._params_with_grad()
        updaters: List[torch.Tensor] = []
        plans: List[Tuple[Dict[str, float], bool]] = []
        for group, p in items:
            s = self._sgd_scalars(p, group)
            g = p.grad
            assert g is not None
            if not self._with_velocity(group):
                updaters.append(g)
                plans.append((s, False))
                continue
            k = "1" if self.use_combined_accum else "2"
            v = self._velocity(p, group)
            if not self.use_combined_accum:
                # v = mm * v + (1-dm) wd vs * w  (SGD2PartialAcclUpdate), in v's dtype
                v.mul_(s["scaledMomentum2"]).add_(
                    (s["scaledWeightDecay1"] * p.float()).to(v.dtype))
            # v += (1-dm) vs / ls * g
            v.add_((s["dampeningScaleFactor" + k] * g.float()).to(v.dtype))
            if group.get("nesterov", False):
                # SGD1Nesterov: u = ngsf * (g / ls + wd * w) + mm * v
                u = (s["nesterovGradScaleFactor" + k]
                     * (g.float() / self._loss_scaling() + s["sgdWeightDecay"] * p.float())
                     + s["sgdMomentum"] * v.float())
            else:
                u = v
            updaters.append(u)
            plans.append((s, True))
        factor = self._clip_factor(updaters)
        for (_group, p), u, (s, with_v) in zip(items, updaters, plans):
            if factor is not None:
                u = u * factor
            if not with_v:
                # SGD0: w = wdsf0 * w - slr0 * g
                new = (s["weightDecayScaleFactor0"] * p.float()
                       - s["scaledLearningRate0"] * u.float())
                p.copy_(new.to(p.dtype))
                continue
            k = "1" if self.use_combined_accum else "2"
            _update_weight(p, u, -s["scaledLearningRate" + k])
            if self.use_combined_accum:
                # Precompute the next step's momentum and weight-decay terms.
                v = self.state[p]["momentum_buffer"]
                v.mul_(s["scaledMomentum1"]).add_(
                    (s["scaledWeightDecay1"] * p.float()).to(v.dtype))
        return loss


class Adam(_AdamBase, torch.optim.Adam):
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


class AdamW(_AdamBase, torch.optim.AdamW):
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


class RMSprop(Optimizer, torch.optim.RMSprop):
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

    def _with_momentum(self, group: Dict[str, Any]) -> bool:
        va = getattr(self, "variable_attrs", None)
        return group["momentum"] != 0.0 or (va is not None and not va.isConstant("momentum"))

    def _rms_state(self, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, Any]:
        state = self.state[p]
        if "square_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            fill = 1.0 if self.use_tf_variant else 0.0
            state["square_avg"] = torch.full_like(
                p, fill, dtype=self.first_order_momentum_accum_type,
                memory_format=torch.preserve_format)
            if group["centered"]:
                state["grad_avg"] = torch.zeros_like(
                    p, dtype=self.second_order_momentum_accum_type,
                    memory_format=torch.preserve_format)
            if self._with_momentum(group):
                state["momentum_buffer"] = torch.zeros_like(
                    p, dtype=torch.float32, memory_format=torch.preserve_format)
        return state

    def _init_device_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self._rms_state(p, group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ls = self._loss_scaling()
        for group, p in self._params_with_grad():
            state = self._rms_state(p, group)
            lr = self._scalar(p, "learningRate", group["lr"])
            wd = self._scalar(p, "weightDecay", group["weight_decay"])
            alpha = self._scalar(p, "alpha", group["alpha"])
            eps = self._scalar(p, "eps", group["eps"])
            mom = self._scalar(p, "momentum", group["momentum"])
            g = self._grad_into_moments(p, ls)
            if wd != 0.0:
                g = g + wd * p.to(g.dtype)
            sq = state["square_avg"]
            g1 = g.to(sq.dtype)
            sq.mul_(alpha).add_(g1 * g1, alpha=1.0 - alpha)
            denom_sq = sq
            if group["centered"]:
                ga = state["grad_avg"]
                ga.mul_(alpha).add_(g.to(ga.dtype), alpha=1.0 - alpha)
                denom_sq = sq - ga.to(sq.dtype) ** 2
            eps_t = torch.tensor(eps, dtype=torch.float32).to(sq.dtype)
            if self.use_tf_variant:
                x = g1 / _sqrt(denom_sq + eps_t)
            else:
                x = g1 / (_sqrt(denom_sq) + eps_t)
            state["step"] += 1.0
            if self._with_momentum(group):
                buf = state["momentum_buffer"]
                if self.use_tf_variant:
                    buf.mul_(mom).add_(x.float(), alpha=lr)
                    _update_weight(p, buf, -1.0)
                else:
                    buf.mul_(mom).add_(x.float())
                    _update_weight(p, buf, -lr)
            else:
                _update_weight(p, x, -lr)
        return loss


class LAMB(_AdamBase, torch.optim.Optimizer):
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
                        max_weight_norm=_FP16_MAX if max_weight_norm is None else max_weight_norm)
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
            if dtype not in _ACCUM_TYPES:
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


def to_ipu_optimizer(optimizer: Any, previous: Optional[torch.optim.Optimizer] = None) -> Any:
    """The device-side optimizer for a PopTorch or plain torch optimizer (see the module's
    docstring). Its param groups are copies over the same parameters; with ``previous`` (the
    device optimizer before ``setOptimizer``) of the same class, the optimizer state carries over
    as it stays on the IPU. Raises what PopTorch raises for an optimizer it does not accept."""
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
    if previous is not None:
        check_replacement(previous, dev)
    if previous is not None and type(previous) is type(dev):
        dev.state = previous.state  # type: ignore[attr-defined]
        if _snapshot(previous) == _snapshot(dev):
            # PopTorch sends nothing when the optimizer is unchanged: values written with
            # load_ipu_state_dict stay on the device.
            dev.__dict__["_ipu_param_overrides"] = previous._overrides()  # type: ignore
    return dev


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


# ---- the device state as PopTorch reads and writes it ---------------------------------------

def _state_names(opt: Optimizer, group: Dict[str, Any]) -> Dict[str, str]:
    """PopART state tensor prefix -> key in ``opt.state[p]``."""
    if isinstance(opt, SGD):
        if not opt._with_velocity(group):
            return {}
        return {("Accl___" if opt.use_combined_accum else "Accl1___"): "momentum_buffer"}
    if isinstance(opt, RMSprop):
        names = {"Accl1___": "square_avg"}
        if group["centered"]:
            names["Accl2___"] = "grad_avg"
        if opt._with_momentum(group):
            names["Accl3___"] = "momentum_buffer"
        return names
    names = {"Accl1___": "exp_avg", "Accl2___": "exp_avg_sq"}
    if isinstance(opt, _AdamBase) and opt._bias_corrected():
        names["Step___"] = "step"
    return names


def _is_variable(opt: Optimizer, attr: str, value: Any, torch_default: Any) -> bool:
    va = getattr(opt, "variable_attrs", None)
    if va is not None:
        return not va.isConstant(attr)
    return value != torch_default


def _param_scalars(opt: Optimizer, p: torch.Tensor, group: Dict[str, Any]) -> Dict[str, float]:
    """The per-weight hyperparameters PopART holds as tensors (the non-constant ones)."""
    if isinstance(opt, SGD):
        return opt._sgd_scalars(p, group)
    out = {"learningRate": opt._scalar(p, "learningRate", group["lr"])}
    wd_default = 1e-2 if isinstance(opt, (AdamW, LAMB)) else 0.0
    if _is_variable(opt, "weight_decay", group["weight_decay"], wd_default):
        out["weightDecay"] = opt._scalar(p, "weightDecay", group["weight_decay"])
    if isinstance(opt, RMSprop):
        for attr, name, default in (("alpha", "alpha", 0.99), ("eps", "eps", 1e-8),
                                    ("momentum", "momentum", 0.0)):
            if _is_variable(opt, attr, group[attr], default):
                out[name] = opt._scalar(p, name, group[attr])
        return out
    if _is_variable(opt, "eps", group["eps"], 1e-8):
        out["eps"] = opt._scalar(p, "eps", group["eps"])
    if isinstance(opt, LAMB) and _is_variable(opt, "max_weight_norm", group["max_weight_norm"],
                                              _FP16_MAX):
        out["maxWeightNorm"] = opt._scalar(p, "maxWeightNorm", group["max_weight_norm"])
    return out


_PARAM_PREFIX = {"beta1": "adamBeta1", "beta2": "adamBeta2", "eps": "adamEps",
                 "alpha": "adaptiveAlpha", "momentum": "adaptiveMomentum"}


def _tensor_name(opt: Optimizer, name: str) -> str:
    if isinstance(opt, RMSprop) and name == "eps":
        return "adaptiveEps"
    if isinstance(opt, SGD):
        return name
    return _PARAM_PREFIX.get(name, name)


def _named(opt: Optimizer, named_parameters: Dict[str, torch.Tensor]
           ) -> List[Tuple[str, torch.Tensor, Dict[str, Any]]]:
    by_id = {id(p): n for n, p in named_parameters.items()}
    out = []
    for group in opt.param_groups:  # type: ignore[attr-defined]
        for p in group["params"]:
            if id(p) in by_id:
                out.append((by_id[id(p)], p, group))
    return out


def ipu_state_dict(opt: Optimizer, named_parameters: Dict[str, torch.Tensor]
                   ) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{"ipu_state": ..., "ipu_param": ...}`` of a device optimizer, named as PopART names the
    tensors (``Accl1___<weight>``, ``learningRate___specific___<weight>``, ``lossScaling_FLOAT``).
    The state is created (zeros, as PopART initialises it) if no step has run yet."""
    init = getattr(opt, "_init_device_state", None)
    if init is not None:
        init()
    ipu_state: Dict[str, torch.Tensor] = {}
    ipu_param: Dict[str, torch.Tensor] = {}
    for name, p, group in _named(opt, named_parameters):
        state = opt.state[p]  # type: ignore[attr-defined]
        for prefix, key in _state_names(opt, group).items():
            if key in state and state[key] is not None:
                ipu_state[prefix + name] = state[key].detach().clone()
        for pname, value in _param_scalars(opt, p, group).items():
            ipu_param[_tensor_name(opt, pname) + "___specific___" + name] = \
                torch.tensor(value, dtype=torch.float32)
    if _is_variable(opt, "loss_scaling", opt._loss_scaling(), 1.0):
        ipu_param["lossScaling_FLOAT"] = torch.tensor(opt._loss_scaling(), dtype=torch.float32)
    return {"ipu_state": ipu_state, "ipu_param": ipu_param}


def load_ipu_state_dict(opt: Optimizer, state: Dict[str, Any],
                        named_parameters: Dict[str, torch.Tensor]) -> None:
    """Write ``state["ipu_state"]`` / ``state["ipu_param"]`` into a device optimizer; tensors the
    dictionaries lack keep their values (PopTorch merges them)."""
    init = getattr(opt, "_init_device_state", None)
    if init is not None:
        init()
    ipu_state = state.get("ipu_state") or {}
    ipu_param = state.get("ipu_param") or {}
    overrides = opt._overrides()
    reverse = {v: k for k, v in _PARAM_PREFIX.items()}
    reverse["adaptiveEps"] = "eps"
    for name, p, group in _named(opt, named_parameters):
        st = opt.state[p]  # type: ignore[attr-defined]
        for prefix, key in _state_names(opt, group).items():
            value = ipu_state.get(prefix + name)
            if value is not None and key in st:
                st[key].copy_(torch.as_tensor(value).to(st[key].dtype).reshape(st[key].shape))
        suffix = "___specific___" + name
        for tname, value in ipu_param.items():
            if tname.endswith(suffix):
                short = tname[: -len(suffix)]
                overrides[(id(p), reverse.get(short, short))] = \
                    torch.as_tensor(value, dtype=torch.float32).reshape(())
    if "lossScaling_FLOAT" in ipu_param:
        overrides[(0, "lossScaling")] = torch.as_tensor(ipu_param["lossScaling_FLOAT"],
                                                        dtype=torch.float32).reshape(())


# ---- PopTorch's optimizer state_dict protocol (PoplarExecutor: setOptimizer, compile, run) ----

def attach_ipu_state(optimizer: Any, device_optimizer: Callable[[], Optional[Optimizer]],
                     named_parameters: Callable[[], Dict[str, torch.Tensor]]) -> None:
    """What PopTorch's ``setOptimizer`` does to one of its optimizers: ``state_dict()`` then
    returns the device's ``ipu_state`` / ``ipu_param``, read back when the device has run since
    the last read (``host_state_is_dirty``), else the cached copy (empty before compiling).
    ``device_optimizer()`` gives the executor's device optimizer (None before compiling),
    ``named_parameters()`` its parameters under the user model's names. Plain torch optimizers
    are left alone, as PopTorch leaves them."""
    if not isinstance(optimizer, Optimizer):
        return

    def state_dict() -> Dict[str, Any]:
        dev = device_optimizer()
        if dev is not None and optimizer.host_state_is_dirty:
            assert not optimizer.ipu_state_is_dirty, (
                "Both host and ipu states cannot be dirty at the same time.")
            optimizer.set_state_dict({
                **ipu_state_dict(dev, named_parameters()),
                **torch.optim.Optimizer.state_dict(optimizer)})  # type: ignore[arg-type]
            optimizer.ipu_state_is_dirty = False
            optimizer.host_state_is_dirty = False
        else:
            logger.debug("Using cached optimiser state dict")
        return optimizer.get_state_dict()

    optimizer.__dict__["state_dict"] = state_dict


def detach_ipu_state(optimizer: Any) -> None:
    """An optimizer replaced by ``setOptimizer``: read its state back one last time, then its
    ``state_dict()`` returns that copy (PopTorch's ``state_dict = get_state_dict``)."""
    if not isinstance(optimizer, Optimizer):
        return
    reader = optimizer.__dict__.get("state_dict")
    if reader is not None:
        reader()
    optimizer.__dict__["state_dict"] = optimizer.get_state_dict


def sync_ipu_state(optimizer: Any, device: Optional[Optimizer],
                   named_parameters: Dict[str, torch.Tensor]) -> None:
    """Call after compiling and before each run: a state loaded with ``load_state_dict`` (or
    present in a new optimizer) is written to the device, merged with what is there; the host
    copy then counts as stale, to be read back by the next ``state_dict()``."""
    if not isinstance(optimizer, Optimizer) or device is None:
        return
    if optimizer.ipu_state_is_dirty:
        assert not optimizer.host_state_is_dirty, (
            "Both host and ipu states cannot be dirty at the same time.")
        if optimizer.has_state():
            load_ipu_state_dict(device, optimizer._state_dict, named_parameters)
        optimizer.ipu_state_is_dirty = False
    optimizer.host_state_is_dirty = True


def popart_optimizer_ops(opt: Optimizer, named_parameters: Dict[str, torch.Tensor]
                         ) -> List[Dict[str, Any]]:
    """The optimizer ops PopART's decomposition patterns put in the IR for each weight
    (``{"type": ..., "name": ...}``, in order), for the executor's ``_debugGetPopartIR``:
    ``SGD0VarUpdate``; ``SGD2PartialAcclUpdate``, ``Accumulate``, ``SGD2VarUpdate`` (separate);
    ``Accumulate``, ``SGD1VarUpdate``, ``SGD1AcclUpdate`` (combined); ``Accumulate`` x2,
    ``AdamUpdater``, ``LambSquare`` x2 (LAMB), ``AdamVarUpdate``; ``Accumulate``,
    ``RMSPropUpdater``, ``ScaledVarUpdate`` (RMSprop)."""
    ops: List[Dict[str, Any]] = []
    for name, _p, group in _named(opt, named_parameters):
        types: List[str] = []
        if isinstance(opt, SGD):
            nesterov = ["SGD1Nesterov"] if group.get("nesterov", False) else []
            if not opt._with_velocity(group):
                types = ["SGD0VarUpdate"]
            elif opt.use_combined_accum:
                types = ["Accumulate"] + nesterov + ["SGD1VarUpdate", "SGD1AcclUpdate"]
            else:
                types = ["SGD2PartialAcclUpdate", "Accumulate"] + nesterov + ["SGD2VarUpdate"]
        elif isinstance(opt, RMSprop):
            types = ["Accumulate"] + (["Accumulate"] if group["centered"] else [])
            types += ["RMSPropUpdater"]
            types += ["Accumulate"] if opt._with_momentum(group) else []
            types += ["ScaledVarUpdate"]
        else:
            types = ["Accumulate", "Accumulate", "AdamUpdater"]
            types += ["LambSquare", "LambSquare"] if isinstance(opt, LAMB) else []
            types += ["AdamVarUpdate"]
        ops.extend({"type": t, "name": f"{t}___{name}"} for t in types)
    return ops


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
                "velocity_scaling": 1.0, "eps": 1e-8, "max_weight_norm": _FP16_MAX,
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
