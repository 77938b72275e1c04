"""u-μP: unit scaling combined with the maximal update parametrization.

u-μP (Blake, Eichenberg, Dean et al., "u-μP: The Unit-Scaled Maximal Update Parametrization",
ICLR 2025, arXiv 2407.17465) keeps unit scaling's promise (unit activations, weights and gradients
at initialisation) and adds μP's (Yang et al. 2022, arXiv 2203.03466): the best learning rate and
other hyperparameters no longer move when the model is made wider or deeper. Its rules, as the
paper states them (its sections 3 and 4) and the published ``unit-scaling`` library implements
them (``unit_scaling/optim.py``, ``_modules.py`` and ``core/functional.py`` there):

- **Weights** are all initialised with unit variance; each tensor has a *type* that decides its
  forward multiplier and its learning rate:

  ============  =========================  =========================================
  type          forward multiplier         Adam / AdamW / SGD learning rate
  ============  =========================  =========================================
  ``embedding`` 1                          ``eta / sqrt(width)`` (width: its fan-out)
  ``hidden``    ``1 / sqrt(fan_in)``       ``eta / sqrt(fan_in)``
  ``output``    ``1 / fan_in``             ``eta``
  ``norm``      (a norm's gain)            ``eta``
  ``bias``      1                          ``eta``
  ============  =========================  =========================================

  and every tensor inside the residual blocks of a stack of ``L`` blocks also has its learning
  rate multiplied by ``1 / sqrt(L)`` (depth-μP, Yang et al. 2023, arXiv 2310.02244).
  :func:`umup_decoder`'s hidden linears tie both passes by unit scaling's geometric mean by
  default, which multiplies the forward ``1 / sqrt(fan_in)`` by ``(fan_in / fan_out) ** 1/4``
  (measured better here; ``"to_output_scale"`` gives the table's; see
  :mod:`ipu_unit_scaling.parametrization.umup_rules`).
  The embedding rule is the paper's own change to μP, which keeps the embedding's rate
  constant in width. The readout's ``1 / fan_in`` is unit scaling's
  ``1 / sqrt(fan_in)`` times a further ``1 / sqrt(fan_in)`` in the forward pass only: its input
  gradient keeps the unit scale ``1 / sqrt(fan_out)`` (the paper's readout, a cut edge).
- **Residuals**: the embedding and each residual branch contribute fixed shares of the residual
  stream's variance, whatever the depth: every attention branch ``a_attn**2 / L`` and every MLP
  branch ``a_mlp**2 / L`` against the embedding's 1, with ``a_mlp**2 = 2 * residual_mult**2 /
  (1 + residual_attn_ratio**2)`` and ``a_attn = residual_attn_ratio * a_mlp``: attention and MLP
  together weigh ``residual_mult**2`` times the embedding on average, attention against MLP
  ``residual_attn_ratio**2`` (the paper's appendix G). See :func:`residual_taus`.
- **Attention** logits are ``attn_softmax_mult * q.k / head_dim`` (μP's ``1/d``, not
  ``1/sqrt(d)``); one constant factor brings the output to unit scale on average over the rows
  (the library's rule; :mod:`ipu_unit_scaling.parametrization.umup_rules`).
- **Nonlinearity**: the MLP computes ``gelu(ffn_act_mult * x)``, unit-scaled (:class:`ScaledGELU`).
- **Loss**: the softmax of the cross-entropy sees ``loss_softmax_mult`` times the readout output.
- **Weight decay** is independent of the learning rate (Wortsman et al. 2024, arXiv 2309.14322):
  a step decays by ``weight_decay`` times the schedule's fraction of the peak rate, whatever the
  peak rate and the tensor's rate scale are (:mod:`ipu_unit_scaling.optim`).

The five multipliers are u-μP's "principled" hyperparameters; all default to 1, as in the paper.
The learning rate ``eta`` is the one that is swept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import activation_ops, unit_ops
from ..ops import ipu_lowering as lowering
from ..ops.scale_constraints import ConstraintArg, apply_constraint

__all__ = [
    "WEIGHT_TYPES",
    "UmupHyperparameters",
    "WeightRule",
    "residual_weights",
    "residual_taus",
    "attention_logit_scale",
    "logit_scale",
    "lr_scale",
    "weight_rules",
    "ScaledGELU",
]

WEIGHT_TYPES = ("embedding", "hidden", "output", "norm", "bias")


@dataclass(frozen=True)
class UmupHyperparameters:
    """u-μP's principled hyperparameters (the paper's alpha_*), each 1 by default."""

    residual_mult: float = 1.0  # alpha_res: residual branches against the embedding
    residual_attn_ratio: float = 1.0  # alpha_res-attn-ratio: attention against MLP branches
    attn_softmax_mult: float = 1.0  # alpha_attn-softmax: attention logits
    ffn_act_mult: float = 1.0  # alpha_ffn-act: the MLP's nonlinearity input
    loss_softmax_mult: float = 1.0  # alpha_loss-softmax: the loss's logits


# ---------------------------------------------------------------------------- residuals


def residual_weights(
    depth: int, residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> List[float]:
    """Variance shares of the 2 x ``depth`` residual branches (attention, MLP, attention, ...),
    against the embedding's share of 1. Each is ``a**2 / depth`` (see the module docstring)."""
    if depth < 1:
        raise ValueError(f"depth={depth} must be at least 1")
    if not residual_mult > 0 or not residual_attn_ratio > 0:
        raise ValueError("residual_mult and residual_attn_ratio must be positive")
    mlp = 2 * residual_mult**2 / (1 + residual_attn_ratio**2)
    attention = residual_attn_ratio**2 * mlp
    return [share / depth for _ in range(depth) for share in (attention, mlp)]


def residual_taus(
    depth: int, residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> List[Tuple[float, float]]:
    """(attention tau, MLP tau) of each layer, for ``U.residual_split`` / ``U.residual_add``.

    ``residual_add`` gives the branch and the skip weights in the ratio tau, their squares summing
    to 1. A branch of share ``w`` joining a stream that holds shares summing to ``W`` (the
    embedding's 1 and every earlier branch's) keeps the shares in proportion when
    ``tau**2 = w / W``.
    """
    shares = residual_weights(depth, residual_mult, residual_attn_ratio)
    taus: List[float] = []
    accumulated = 1.0  # the embedding's share
    for share in shares:
        taus.append(math.sqrt(share / accumulated))
        accumulated += share
    return [(taus[2 * i], taus[2 * i + 1]) for i in range(depth)]


# ---------------------------------------------------------------------------- multipliers


def attention_logit_scale(head_dim: int, attn_softmax_mult: float = 1.0) -> float:
    """The scale of attention logits, ``attn_softmax_mult / head_dim`` (μP's 1/d)."""
    return attn_softmax_mult / head_dim


def logit_scale(fan_in: int, loss_softmax_mult: float = 1.0) -> float:
    """What multiplies a unit-scaled readout's output (already ``1 / sqrt(fan_in)``) to give
    u-μP's ``1 / fan_in`` readout, with the loss softmax's multiplier folded in."""
    return loss_softmax_mult / math.sqrt(fan_in)


class ScaledGELU:
    """Unit-scaled ``gelu(mult * x)``: u-μP's ``ffn_act_mult`` shapes the nonlinearity.

    Rule: output scale ``1/std(gelu(mult z))``, grad-input scale ``1/rms(d/dz gelu(mult z))``
    for z ~ N(0, 1), computed once by Gauss-Hermite quadrature and tied by ``constraint``
    (``model.umup_gelu_constraint``; the default is ``U.gelu``'s and the library's); at
    ``mult=1`` it is ``U.gelu``. (The published library fits an interpolation in ``mult``; the
    quadrature is exact for normal inputs.) A callable object, so that the scales are computed
    when the model is built and a compiled or traced forward sees constants.
    """

    def __init__(self, mult: float = 1.0, approximate: str = "none",
                 constraint: ConstraintArg = "to_output_scale") -> None:
        if not mult > 0:
            raise ValueError(f"mult={mult!r} must be positive")
        self.mult = mult
        self.approximate = approximate
        self.constraint = constraint
        # Scales of torch's GELU and of the one an IPU runs (see U.gelu), by U.gelu's
        # quadrature.
        self.scales = {
            form: apply_constraint(
                constraint, *(1 / m for m in activation_ops.gelu_moments(form, mult)))
            for form in {approximate, lowering.gelu_on_ipu(approximate)}}
        self.output_scale, self.grad_scale = self.scales[approximate]

    def __call__(self, input: Tensor) -> Tensor:
        output_scale, grad_scale = self.scales[activation_ops.active_gelu_form(self.approximate)]
        return unit_ops.scaled_call(self._gelu, (input,), output_scale, (grad_scale,),
                                   scale_in_place=True)

    def _gelu(self, x: Tensor) -> Tensor:
        return F.gelu(x * self.mult if self.mult != 1.0 else x, approximate=self.approximate)

    def __repr__(self) -> str:
        return (f"ScaledGELU(mult={self.mult}, approximate={self.approximate!r}, "
                f"constraint={self.constraint!r})")


# ---------------------------------------------------------------------------- weight types


@dataclass(frozen=True)
class WeightRule:
    """What u-μP needs to know about one parameter: its type, shape and residual depth."""

    weight_type: str  # one of WEIGHT_TYPES
    shape: Tuple[int, ...]
    residual_depth: Optional[int] = None  # blocks in the residual stack it belongs to, if any

    def __post_init__(self) -> None:
        if self.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"weight_type {self.weight_type!r} must be one of {WEIGHT_TYPES}")


def lr_scale(rule: WeightRule) -> float:
    """The factor on the global learning rate for one tensor (the table in the module docstring).

    The same for Adam, AdamW and SGD: with unit-scaled gradients at every weight (the readout's
    input gradient keeps its own unit scale), an SGD step at init is as large as an Adam step,
    so the rules coincide; the published library makes the same choice for a readout without a
    constraint (``lr_scale_func_sgd(None)``).
    """
    if rule.weight_type == "embedding":
        scale = rule.shape[-1] ** -0.5  # the width it writes to: an embedding's fan-out
    elif rule.weight_type == "hidden":
        scale = math.prod(rule.shape[1:]) ** -0.5  # fan-in
    else:
        scale = 1.0
    if rule.residual_depth is not None:
        scale *= rule.residual_depth**-0.5
    return scale


_NORMS = (nn.LayerNorm, nn.GroupNorm)


def weight_rules(
    model: nn.Module,
    readout: Sequence[str] = ("head",),
    residual_blocks: Sequence[str] = ("layers",),
) -> Dict[str, WeightRule]:
    """The u-μP type of every parameter of ``model``, by qualified name.

    Embeddings are ``embedding``; linear weights ``hidden``, except those of the modules named in
    ``readout`` (``output``); norm gains ``norm``; biases ``bias``. Parameters under a module
    named in ``residual_blocks`` (a list of blocks, like the GPT's ``layers``) get that list's
    length as their residual depth. Works for the package's GPT (the defaults), for
    ``unit_scale``-converted models and any model built from ``uu`` modules; a parameter of any
    other kind raises ValueError naming it, since u-μP has no rule for a tensor it cannot type.
    """
    depths: Dict[str, int] = {}
    for name in residual_blocks:
        blocks = model.get_submodule(name)
        depths[name] = len(blocks)  # type: ignore[arg-type]
    missing = [name for name in readout if name not in dict(model.named_modules())]
    if missing:
        raise ValueError(f"readout module(s) {missing} not found in {type(model).__name__}")
    rules: Dict[str, WeightRule] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            qualified = f"{module_name}.{param_name}" if module_name else param_name
            weight_type = _weight_type(module, module_name, param_name, readout)
            if weight_type is None:
                raise ValueError(
                    f"u-μP has no rule for parameter {qualified!r} of a "
                    f"{type(module).__name__}: only embeddings, linear layers and norms are typed"
                )
            depth = next((d for prefix, d in depths.items()
                          if qualified.startswith(prefix + ".")), None)
            rules[qualified] = WeightRule(weight_type, tuple(param.shape), depth)
    return rules


def _weight_type(module: nn.Module, module_name: str, param_name: str,
                 readout: Sequence[str]) -> Optional[str]:
    if param_name == "bias":
        return "bias"
    if param_name != "weight":
        return None
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear):
        return "output" if module_name in readout else "hidden"
    if isinstance(module, _NORMS):
        return "norm"
    return None
