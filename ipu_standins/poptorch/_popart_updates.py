"""PopART's optimizer update rules, which the stand-in runs where PopART runs them on the IPU.

The rules of ``willow/include/popart/sgd.hpp``, ``adam.hpp`` and ``adaptive.hpp`` in the dtypes
PopART keeps (see :mod:`.optim` for what each rule does). Each is a base class of the
``poptorch.optim`` optimizer it updates: :class:`SGDRule` (SGD0, SGD1 combined, SGD2 separate),
:class:`AdamRule` (Adam, AdamW, Lamb) and :class:`RMSpropRule` (Adaptive RMSProp and
CenteredRMSProp). :class:`DeviceUpdate` holds what they share: the hyperparameters as the device
holds them, the loss scaling and PopART's gradient clipping.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["AutoLossScale", "DeviceUpdate", "SGDRule", "AdamRule", "RMSpropRule",
           "sqrt_in_dtype", "update_weight"]

_FP16_MAX = 65504.0  # the largest float16: the scale of the histogram's bin edge


def sqrt_in_dtype(t: torch.Tensor) -> torch.Tensor:
    """Square root in ``t``'s dtype (float16 through float32, which rounds it correctly: torch
    2.0.1 has no float16 sqrt on the CPU)."""
    return t.float().sqrt().to(t.dtype)


def update_weight(p: torch.Tensor, update: torch.Tensor, scale: float) -> None:
    """``p += scale * update``, computed in float32 and rounded once to the weight's dtype."""
    p.copy_((p.float() + scale * update.float()).to(p.dtype))


class AutoLossScale:
    """PopART's automatic loss scaling (``transforms/automaticlossscaling.cpp``,
    ``popx/op/lossscaleupdatex.cpp``): a loss scale update factor (a float32 variable, one at
    first) multiplies the optimizer's loss scaling into the final loss scale the backward pass
    starts from, and divides the inverse loss scale of the weight update. Every ``period``-th
    optimizer step (the first of each period) the absolute values of the tracked float16
    gradients are counted into two bins, below and from ``bin_edge * 65504`` upwards; then the
    factor halves if the upper count is more than ``threshold / (1 - threshold)`` times the
    lower count, and doubles otherwise, for the next step.

    PopART tracks the float16 outputs of the gradient ops (activation gradients too); the
    stand-in tracks the float16 weights' gradients, one micro-batch at a time as PopART sums
    its counts over gradient accumulation, and counts a NaN as an overflow (upper bin)."""

    def __init__(self, bin_edge: float = 0.125, threshold: float = 1e-7,
                 period: int = 1) -> None:
        if not 0.0 <= bin_edge <= 1.0:
            raise ValueError(f"automaticLossScalingSettings.binEdgeLocation must be in [0, 1], "
                             f"not {bin_edge}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError("automaticLossScalingSettings.thresholdUpperCountProportion must "
                             f"be in [0, 1], not {threshold}")
        if period < 1:
            raise ValueError(f"automaticLossScalingSettings.updatePeriod must be at least 1, "
                             f"not {period}")
        self.edge = _FP16_MAX * bin_edge
        self.threshold = threshold
        self.period = period
        self.update_factor = torch.ones((), dtype=torch.float32)
        self.steps = 0
        self.counts = [0, 0]  # lower, upper

    @classmethod
    def from_options(cls, popart: Dict[str, Any]) -> Optional[AutoLossScale]:
        """The settings of PopTorch's ``opts._Popart`` options, or None if not enabled."""
        prefix = "automaticLossScalingSettings."
        if not popart.get(prefix + "enabled", False):
            return None
        return cls(float(popart.get(prefix + "binEdgeLocation", 0.125)),
                   float(popart.get(prefix + "thresholdUpperCountProportion", 1e-7)),
                   int(popart.get(prefix + "updatePeriod", 1)))

    def counting(self) -> bool:
        """Whether this step's gradients are counted (the first step of each period)."""
        return self.steps % self.period == 0

    def observe(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Count one micro-batch's float16 gradients into the two bins."""
        if not self.counting():
            return
        for g in grads:
            if g is None or g.dtype != torch.float16:
                continue
            magnitude = g.detach().float().abs()
            upper = int(((magnitude >= self.edge) | magnitude.isnan()).sum())
            self.counts[0] += g.numel() - upper
            self.counts[1] += upper

    def backward(self, params: List[torch.Tensor], run: Callable[[], Any]) -> None:
        """Run one micro-batch's backward pass (``run``), counting the gradients it adds to
        ``params`` on a counting step."""
        if not self.counting():
            run()
            return
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        run()
        self.observe([p.grad for p in params])
        for p, g in zip(params, before):
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)

    def update(self) -> None:
        """After the optimizer step: halve or double the factor from the counts."""
        if self.counting():
            lower, upper = self.counts
            ratio = self.threshold / (1.0 - self.threshold) if self.threshold < 1.0 \
                else math.inf
            scale_down = float(upper) > ratio * float(lower)
            self.update_factor = self.update_factor * (0.5 if scale_down else 2.0)
            self.counts = [0, 0]
        self.steps += 1


class DeviceUpdate:
    """What the update rules share. The attributes are the optimizer's own (torch's
    ``param_groups`` and ``state``, PopTorch's arguments)."""

    param_groups: List[Dict[str, Any]]
    state: Any
    loss_scaling: float
    use_combined_accum: bool
    velocity_accum_type: torch.dtype
    use_tf_variant: bool
    first_order_momentum_accum_type: torch.dtype
    second_order_momentum_accum_type: torch.dtype


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
        """The optimizer's loss scaling, as PopART's ``lossScaling_FLOAT`` holds it."""
        ov = self._overrides().get((0, "lossScaling"))
        return float(ov) if ov is not None else float(self.loss_scaling)

    def auto_loss_scale(self) -> Optional[AutoLossScale]:
        return self.__dict__.get("_auto_loss_scale")

    def _ls_factor(self) -> float:
        als = self.auto_loss_scale()
        return float(als.update_factor) if als is not None else 1.0

    def final_loss_scale(self) -> float:
        """The loss scale the backward pass starts from (and the update divides by): the loss
        scaling times the automatic loss scaling's update factor."""
        return self._loss_scaling() * self._ls_factor()

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


class AdamRule(DeviceUpdate):
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
        ls = self.final_loss_scale()
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
            v_hat = sqrt_in_dtype(v / c2)
        else:
            m_hat = m.clone()
            v_hat = sqrt_in_dtype(v)
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
        update_weight(p, upd, -scale)


class SGDRule(DeviceUpdate):
    """PopART's SGD0 / SGD1 (combined) / SGD2 (separate)."""

    # Dampening on the first step. torch.optim.SGD starts the momentum buffer at the first
    # gradient, undamped (buf = g), and dampens from the second step on. PopART keeps no step
    # count: its rule (willow/include/popart/sgd.hpp, "Basic SGD Update Equation") is
    # v = v * mm + (1 - dm) * g + (1 - dm) * wd * w on every step, from v_0 = 0 unless the
    # model holds an initial value (willow/src/op/sgd2acclupdate.cpp, "Initial v"; SGD1's
    # combined tensor starts at (1 - dm) * wd * vs * w, willow/src/patterns/sgd1decompose.cpp),
    # so the first velocity is (1 - dm) * (g + wd * w). PopTorch runs PopART's optimizer (its
    # optim.py passes the hyperparameters on and runs no update of its own), so the "identical
    # to PyTorch" of its SGD docstring holds for dm = 0 only; with dampening the stand-in follows
    # PopART and applies it from the first step.


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
        # Automatic loss scaling divides PopART's inverse loss scale tensors (the SGD0 scaled
        # learning rate, the dampening scale factor) by its update factor (util.cpp's
        # getInverseLossScaleTensors, sgd.cpp's getInverseLossScalingTensorId).
        factor = self._ls_factor()
        for group, p in items:
            s = self._sgd_scalars(p, group)
            if factor != 1.0:
                s = dict(s)
                for name in ("scaledLearningRate0", "dampeningScaleFactor1",
                             "dampeningScaleFactor2"):
                    if name in s:
                        s[name] = s[name] / factor
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
                     * (g.float() / self.final_loss_scale() + s["sgdWeightDecay"] * p.float())
                     + s["sgdMomentum"] * v.float())
            else:
                u = v
            updaters.append(u)
            plans.append((s, True))
        clip = self._clip_factor(updaters)
        for (_group, p), u, (s, with_v) in zip(items, updaters, plans):
            if clip is not None:
                u = u * clip
            if not with_v:
                # SGD0: w = wdsf0 * w - slr0 * g
                new = (s["weightDecayScaleFactor0"] * p.float()
                       - s["scaledLearningRate0"] * u.float())
                p.copy_(new.to(p.dtype))
                continue
            k = "1" if self.use_combined_accum else "2"
            update_weight(p, u, -s["scaledLearningRate" + k])
            if self.use_combined_accum:
                # Precompute the next step's momentum and weight-decay terms.
                v = self.state[p]["momentum_buffer"]
                v.mul_(s["scaledMomentum1"]).add_(
                    (s["scaledWeightDecay1"] * p.float()).to(v.dtype))
        return loss


class RMSpropRule(DeviceUpdate):
    """PopART's Adaptive RMSProp and CenteredRMSProp."""

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
        ls = self.final_loss_scale()
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
                x = g1 / sqrt_in_dtype(denom_sq + eps_t)
            else:
                x = g1 / (sqrt_in_dtype(denom_sq) + eps_t)
            state["step"] += 1.0
            if self._with_momentum(group):
                buf = state["momentum_buffer"]
                if self.use_tf_variant:
                    buf.mul_(mom).add_(x.float(), alpha=lr)
                    update_weight(p, buf, -1.0)
                else:
                    buf.mul_(mom).add_(x.float())
                    update_weight(p, buf, -lr)
            else:
                update_weight(p, x, -lr)
        return loss
