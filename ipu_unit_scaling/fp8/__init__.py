"""FP8: formats, the AMAX scaling-bias rule, casts and FP8 linear layers (a model's linear
layers become FP8 ones with :func:`ipu_unit_scaling.transforms.simulate_fp8`).

Convention: ``q = encode(x * 2**s)``, ``x ~= decode(q) * 2**-s`` with
``s = clamp(floor(log2(fmt.max / amax)) - margin, -31, 31)``.
"""
from __future__ import annotations

from .attention import FP8AttentionFn, fp8_attention, fp8_scaled_dot_product_attention
from .cast_ops import fp8_quantise, fp8_quantise_gradient
from .codec import decode, encode, quantise, stochastic_round_to_grid
from .fp8_config import FP8Config, FP8ConfigError
from .fp8_formats import E4M3FN, E5M2, F143, F152, FORMATS, FP8Format, get_format
from .linear import FP8Linear, FP8UnitScaledLinear, fp8_linear, fp8_matmul, scaled_mm_supported
from .scaling import (
    MAX_LOG2_SCALE,
    MAX_MARGIN,
    Fp8Tensor,
    NonFiniteAmaxError,
    cast_from_fp8,
    cast_to_fp8,
    cast_to_fp8_reference,
    log2_scale,
)
from .stats import CastRecord, Fp8Stats, fp8_stats

__all__ = [
    "FP8Format", "F143", "F152", "E4M3FN", "E5M2", "FORMATS", "get_format",
    "encode", "decode", "quantise", "stochastic_round_to_grid",
    "MAX_LOG2_SCALE", "MAX_MARGIN", "NonFiniteAmaxError", "log2_scale",
    "Fp8Tensor", "cast_to_fp8", "cast_to_fp8_reference", "cast_from_fp8",
    "FP8Config", "FP8ConfigError", "FP8Linear", "FP8UnitScaledLinear", "fp8_linear", "fp8_matmul",
    "scaled_mm_supported", "fp8_attention", "fp8_scaled_dot_product_attention",
    "FP8AttentionFn", "CastRecord", "Fp8Stats", "fp8_stats",
    "fp8_quantise", "fp8_quantise_gradient",
]
