"""Precision regimes: the model a config describes, in FP32, simulated FP16 or simulated FP8.

``compare`` trains one model per regime; ``build_model`` is the one place a run's model is
built, so every key of the ``model`` and ``precision`` sections reaches it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops as U
from ..fp8.fp8_config import RECIPES, FP8Config, field_is_free
from ..models.gpt import GPTConfig, build_gpt
from ..modules.layers import LinearReadout
from .config_files import ConfigError
from .config_names import MODEL_KINDS, REGIMES
from .run_config import UMUP_MULTIPLIERS, UMUP_RULE_CHOICES, Config

__all__ = ["REGIME_SETTINGS", "COMPARE_EVAL_POINTS", "regime_config", "RECIPE_NAMES",
           "recipe_regimes", "regime_settings", "is_regime",
           "with_model_kind", "model_kind", "model_label", "round_to_half",
           "FP16Linear", "simulate_fp16", "build_model"]

# regime -> (model: plain, unit or u-mup; precision dtype; FP8 scaling)
REGIME_SETTINGS: Dict[str, Tuple[str, str, str]] = {
    "fp32": ("plain", "fp32", "amax"),
    "fp16": ("plain", "fp16", "amax"),
    "fp8-naive": ("plain", "fp8", "static"),
    "fp8-amax": ("plain", "fp8", "amax"),
    "unit-fp32": ("unit", "fp32", "amax"),
    "unit-fp16": ("unit", "fp16", "amax"),
    "unit-fp8": ("unit", "fp8", "static"),
    "unit-fp8-amax": ("unit", "fp8", "amax"),
    "umup-fp32": ("u-mup", "fp32", "amax"),
    "umup-fp16": ("u-mup", "fp16", "amax"),
    "umup-fp8": ("u-mup", "fp8", "static"),
    "umup-fp8-amax": ("u-mup", "fp8", "amax"),
}
assert set(REGIME_SETTINGS) == set(REGIMES)
assert {kind for kind, _, _ in REGIME_SETTINGS.values()} == set(MODEL_KINDS)
# compare draws one validation curve per regime: at least this many points where steps allow.
COMPARE_EVAL_POINTS = 10

# FP8 recipes ``compare --recipes`` trains, each on the plain and the unit-scaled GPT: regimes
# ``fp8-<recipe>`` and ``unit-fp8-<recipe>`` (static and amax are the regimes fp8-naive,
# unit-fp8, fp8-amax and unit-fp8-amax). Their learning rates are the amax regimes'.
RECIPE_NAMES = tuple(RECIPES)
_NAMED_RECIPE_REGIMES = {("plain", "static"): "fp8-naive", ("unit", "static"): "unit-fp8",
                         ("plain", "amax"): "fp8-amax", ("unit", "amax"): "unit-fp8-amax"}
_RECIPE_PREFIXES = {"plain": "fp8-", "unit": "unit-fp8-"}


def recipe_regimes(recipes: Sequence[str]) -> List[str]:
    """The regimes of ``compare --recipes``: fp32 on both models, then each recipe on both."""
    unknown = [name for name in recipes if name not in RECIPES]
    if unknown:
        raise ValueError(f"unknown FP8 recipe {unknown[0]!r}; allowed: {', '.join(RECIPES)}")
    regimes = ["fp32", "unit-fp32"]
    for recipe in recipes:
        for kind in ("plain", "unit"):
            regimes.append(_NAMED_RECIPE_REGIMES.get((kind, recipe),
                                                     _RECIPE_PREFIXES[kind] + recipe))
    return regimes


def regime_settings(regime: str) -> Tuple[str, str, str]:
    """(model kind, precision dtype, FP8 recipe) of a regime of REGIME_SETTINGS or a recipe
    regime (``fp8-mx``, ``unit-fp8-block``, ...); ValueError for others."""
    if regime in REGIME_SETTINGS:
        return REGIME_SETTINGS[regime]
    for kind in ("unit", "plain"):
        recipe = regime[len(_RECIPE_PREFIXES[kind]):]
        if regime.startswith(_RECIPE_PREFIXES[kind]) and recipe in RECIPES:
            return kind, "fp8", recipe
    raise ValueError(f"unknown regime {regime!r}; allowed: {', '.join(REGIMES)}, or "
                     f"fp8-<recipe> and unit-fp8-<recipe> for the recipes "
                     f"{', '.join(RECIPES)}")


def is_regime(name: str) -> bool:
    """Whether ``name`` is a regime (of REGIME_SETTINGS, or a recipe regime)."""
    try:
        regime_settings(name)
    except ValueError:
        return False
    return True


def _regime_fp8(fp8: FP8Config, recipe: str,
                recipe_settings: Mapping[str, Any]) -> FP8Config:
    """The run's FP8 section in ``recipe``: a recipe that names no formats (all but mx, mxfp4
    and nvfp4) keeps the configured ones; ``recipe_settings`` (block size, amax history) apply
    where the recipe reads them (``field_is_free``)."""
    regime = fp8.with_recipe(recipe)
    if "activation_format" not in RECIPES[recipe]:
        regime = dataclasses.replace(regime, activation_format=fp8.activation_format,
                                     weight_format=fp8.weight_format,
                                     gradient_format=fp8.gradient_format)
    settings = {name: value for name, value in recipe_settings.items()
                if field_is_free(name, regime.scaling)}
    return dataclasses.replace(regime, **settings) if settings else regime


def regime_config(config: Config, regime: str,
                  recipe_settings: Optional[Mapping[str, Any]] = None) -> Config:
    """``config`` set to one comparison regime: model build, precision, learning rate, and an
    evaluation interval that gives every curve at least ten points. ``recipe_settings``:
    FP8 fields of :data:`~ipu_unit_scaling.fp8.fp8_config.RECIPE_TUNING_FIELDS` for the
    recipes that read them (``compare --recipes block --set precision.fp8.block_size=64``)."""
    model, dtype, recipe = regime_settings(regime)
    if config.model.factory is not None:
        raise ConfigError([("model.factory", (
            "compare trains the GPT plain, unit-scaled and in u-μP; a given model has one form: "
            "train it with 'train', once per --set precision.dtype=fp32/fp16/fp8"))])
    training = config.training
    most = max(1, training.steps // COMPARE_EVAL_POINTS)
    eval_interval = (most if training.eval_interval == 0 or training.eval_interval > most
                     else training.eval_interval)
    rates = config.compare.learning_rates
    rate = rates[regime] if regime in rates else rates[
        "unit-fp8-amax" if model == "unit" else "fp8-amax"]
    return dataclasses.replace(
        config, model=with_model_kind(config.model, model),
        precision=dataclasses.replace(
            config.precision, dtype=dtype,
            fp8=_regime_fp8(config.precision.fp8, recipe, recipe_settings or {})),
        training=dataclasses.replace(training, learning_rate=rate, eval_interval=eval_interval),
    )


def with_model_kind(model: GPTConfig, kind: str) -> GPTConfig:
    """The model section ``model`` made a plain, unit-scaled or u-μP GPT. Each takes the model
    keys that apply to it: the others go back to their defaults (u-μP's multipliers outside
    u-μP, unit scaling's taus inside it), so the result always validates."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r} is not one of {', '.join(MODEL_KINDS)}")
    defaults = type(model)()
    reset = (("attn_tau", "mlp_tau") if kind == "u-mup"
             else (*UMUP_MULTIPLIERS, *UMUP_RULE_CHOICES))
    changes: Dict[str, Any] = {name: getattr(defaults, name) for name in reset}
    changes.update(unit_scaled=kind != "plain",
                   parametrization="u-mup" if kind == "u-mup" else "unit")
    return dataclasses.replace(model, **changes)


def model_kind(model: GPTConfig) -> str:
    """``plain``, ``unit`` or ``u-mup``: the kind of the model section ``model`` (what
    :func:`with_model_kind` set)."""
    if not model.unit_scaled:
        return "plain"
    return "u-mup" if model.parametrization == "u-mup" else "unit"


def model_label(model: GPTConfig, noun: str = "GPT") -> str:
    """How figures and headers name the model section ``model``: ``unit-scaled GPT``, ``u-μP GPT``,
    ``plain GPT`` (``noun`` names the task's model), or a given model by its factory
    (``my_model:build (model.factory)``), whose build the other keys do not describe."""
    factory = getattr(model, "factory", None)
    if factory:
        return f"{factory} (model.factory)"
    kind = {"unit": "unit-scaled", "u-mup": "u-μP"}.get(model_kind(model), "plain")
    return f"{kind} {noun}"


def round_to_half(x: Tensor) -> Tensor:
    """``x`` as float16 would hold it (overflow to inf, underflow to zero), gradient likewise.

    A round trip through float16: autograd of the two casts rounds the gradient the same way,
    so eager PyTorch and PopTorch's traced graph compute the same thing while casts round to
    nearest. With ``ipu.stochastic_rounding`` an IPU rounds both casts (the value's and the
    gradient's) stochastically; the emulator backend does too
    (:mod:`ipu_unit_scaling.ops.ipu_lowering`), the CPU backend rounds to nearest.
    """
    return x.to(torch.float16).to(x.dtype)


class FP16Linear(nn.Linear):
    """A linear layer whose matmul sees float16 operands and produces a float16 result.

    Input, weight and output are rounded to float16 in the forward pass; the output gradient
    and the input and weight gradients in the backward pass: the casts of an FP16 matmul with
    float32 accumulation, at the places FP8 casts go. A unit-scaled layer (``unit_scaled``, any
    ``uu.Linear`` whatever its constraint, u-μP's readout's ``None`` included) keeps its scales
    inside the rounding, as hardware that fuses them into the matmul would.
    """

    constraint: Optional[Any]
    unit_scaled: bool = False
    readout: bool = False  # a uu.LinearReadout: U.linear_readout's 1 / fan_in output scale

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP16Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias  # type: ignore[assignment]
        # The test simulate_fp8 uses: a linear with a constraint attribute is unit-scaled.
        new.unit_scaled = hasattr(linear, "constraint")
        new.constraint = getattr(linear, "constraint", None)
        new.readout = isinstance(linear, LinearReadout)
        return new

    def forward(self, input: Tensor) -> Tensor:
        weight = round_to_half(self.weight)
        bias = None if self.bias is None else round_to_half(self.bias)
        if self.readout:
            output = U.linear_readout(round_to_half(input), weight, bias, self.constraint)
        elif self.unit_scaled:
            output = U.linear(round_to_half(input), weight, bias, self.constraint)
        else:
            output = F.linear(round_to_half(input), weight, bias)
        return round_to_half(output)


def simulate_fp16(model: nn.Module) -> nn.Module:
    """Make every linear layer of ``model`` an :class:`FP16Linear`, in place (no loss scaling)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not isinstance(child, FP16Linear):
                setattr(parent, name, FP16Linear.from_linear(child))
    return model


def build_model(config: Config) -> nn.Module:
    """The example GPT that ``config.model`` describes (or the model its ``factory`` builds,
    :mod:`.given_model`), in ``config.precision``."""
    model: nn.Module
    if config.model.factory is not None:
        from .given_model import build_given_model

        model = build_given_model(config.model)
    else:
        model = build_gpt(config.model)
    if config.precision.dtype == "fp8":
        from ..transforms import simulate_fp8

        model = simulate_fp8(model, config.precision.fp8)
    elif config.precision.dtype == "fp16":
        model = simulate_fp16(model)
    return model
