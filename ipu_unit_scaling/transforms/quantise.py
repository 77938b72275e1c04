"""`simulate_fp8` and `simulate_format`: FP8 (or another low-precision format) in a module's
matmuls, on any device.

`simulate_fp8` has two forms, told apart by its `config` argument:

- `simulate_fp8(module)`, unit-scaling's call, and `simulate_format(module, fwd_format,
  bwd_format)` return a **copy** of the module; the module given is left unchanged. The casts
  are plain ones (no scaling bias): what unit scaling makes possible. Each `F.linear` and
  `F.scaled_dot_product_attention` call of the captured forward graph, and each `torch.addmm`
  (the matmul of Hugging Face's `Conv1D`), (see `compose`; nn modules are traced through, and
  so are this package's unit-scaled ops, whose matmuls run on their unscaled inputs) gets its
  tensor inputs quantised in the forward pass to `fwd_format`, and the gradient of its output
  quantised in the backward pass to `bwd_format`. Everything else runs as before, in the input
  precision.
- `simulate_fp8(model, FP8Config(...))`, this package's FP8 (the IPU's casts, with per-tensor
  scaling biases under FP8-AMAX), **changes the model in place** and returns it: its linear
  layers (and Hugging Face `Conv1D` layers) become :class:`~ipu_unit_scaling.fp8.FP8Linear`
  and :class:`~ipu_unit_scaling.fp8.FP8UnitScaledLinear` layers that share its parameters.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..fp8.attention import FP8AttentionFn
from ..fp8.conv1d import FP8Conv1D, FP8UnitScaledConv1D, is_conv1d
from ..fp8.fp8_config import FP8Config
from ..fp8.generic_formats import FPFormat
from ..fp8.linear import FP8Linear, FP8UnitScaledLinear
from .compose import Backend, apply_transform
from .keep_structure import mark_converted
from .replacements import CONSTRAINT, UnitConv1D

__all__ = ["simulate_format", "simulate_fp8"]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)


# Formats travel in the graph as tuples of plain values: generated graph code can hold those.
FormatSpec = Tuple[int, int, str, int]


def _spec(fmt: FPFormat) -> FormatSpec:
    return (fmt.exponent_bits, fmt.mantissa_bits, fmt.rounding, fmt.srbits)


def _quantised_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
                      fwd_format: FormatSpec, bwd_format: FormatSpec) -> Tensor:
    forward, backward = FPFormat(*fwd_format), FPFormat(*bwd_format)
    output = F.linear(forward.quantise_fwd(input), forward.quantise_fwd(weight), bias)
    return backward.quantise_bwd(output)


def _quantised_attention(query: Tensor, key: Tensor, value: Tensor, *args: Any,
                         fwd_format: FormatSpec, bwd_format: FormatSpec,
                         **kwargs: Any) -> Tensor:
    forward, backward = FPFormat(*fwd_format), FPFormat(*bwd_format)
    query, key, value = (forward.quantise_fwd(t) for t in (query, key, value))
    output = F.scaled_dot_product_attention(query, key, value, *args, **kwargs)
    return backward.quantise_bwd(output)


def _quantised_addmm(input: Tensor, mat1: Tensor, mat2: Tensor, *, beta: Any = 1,
                     alpha: Any = 1, fwd_format: FormatSpec, bwd_format: FormatSpec) -> Tensor:
    """`torch.addmm` (Hugging Face's Conv1D: bias + x @ weight) with its matmul's operands
    quantised, as `_quantised_linear` does a linear's."""
    forward, backward = FPFormat(*fwd_format), FPFormat(*bwd_format)
    output = torch.addmm(input, forward.quantise_fwd(mat1), forward.quantise_fwd(mat2),
                         beta=beta, alpha=alpha)
    return backward.quantise_bwd(output)


_QUANTISED: Dict[Any, Callable[..., Tensor]] = {
    F.linear: _quantised_linear,
    torch.addmm: _quantised_addmm,
    F.scaled_dot_product_attention: _quantised_attention,
}


def _quantisation_backend(fwd_format: FPFormat, bwd_format: FPFormat) -> Backend:
    def quantise(gm: fx.GraphModule, example_inputs: List[Tensor]) -> fx.GraphModule:
        logger.info("running quantisation backend")
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in _QUANTISED:
                logger.info("quantising function: %s", node)
                node.target = _QUANTISED[node.target]
                node.kwargs = {**node.kwargs, "fwd_format": _spec(fwd_format),
                               "bwd_format": _spec(bwd_format)}
        gm.graph.lint()
        gm.recompile()
        return gm

    quantise.is_quantisation = True  # type: ignore[attr-defined]
    return quantise


def simulate_format(module: M, fwd_format: FPFormat, bwd_format: FPFormat) -> M:
    """A copy of `module` whose linear and attention matmuls take `fwd_format` inputs and give
    `bwd_format` output gradients (see the module docstring). Simulated in the input
    precision: for the numerics, not for speed. A Hugging Face model's copy is of a subclass
    named `FP8Simulated<Name>` (see `keep_structure.mark_converted`)."""
    copied = apply_transform(module, _quantisation_backend(fwd_format, bwd_format))
    mark_converted(copied, "FP8Simulated")
    return copied


def simulate_fp8(module: M, config: Optional[Union[FP8Config, str]] = None) -> M:
    """FP8 in `module`'s matmuls: a copy without `config`, the module itself changed with one.

    - `simulate_fp8(module)` (unit-scaling's call) returns a **copy** of `module`, which is left
      unchanged: `simulate_format` with E4M3 in the forward pass and E5M2 in the backward pass
      (the IPU's F143 and F152 grids), stochastically rounded, without scaling biases.
    - `simulate_fp8(model, config)` with an :class:`~ipu_unit_scaling.fp8.FP8Config`
      **changes `model` in place** and returns it. Every ``torch.nn.Linear`` becomes an
      :class:`~ipu_unit_scaling.fp8.FP8Linear` and every unit-scaled ``uu.Linear`` an
      :class:`~ipu_unit_scaling.fp8.FP8UnitScaledLinear`, and every Hugging Face ``Conv1D``
      (GPT-2's projections, weight stored transposed) and ``unit_scale``'s unit-scaled one an
      ``FP8Conv1D`` / ``FP8UnitScaledConv1D`` (:mod:`ipu_unit_scaling.fp8.conv1d`) that keeps
      the weight's name and shape; they share the original parameters, so they follow the
      model's dtype (``.half()``) and its state dict loads into them unchanged. A Hugging Face
      model's class becomes a subclass named ``FP8<Name>``: code that would rebuild it from
      its config and drop the FP8 layers (Optimum Graphcore's ``to_pipelined``) refuses it.
      Other ``nn.Linear`` subclasses are left alone (e.g. ``nn.MultiheadAttention``'s
      ``out_proj``, whose forward that module never calls). A bare ``nn.Linear`` passed as
      `model` cannot be replaced in place: its FP8 version is returned. With
      ``config.attention``, every module's attention function (an ``attention_fn`` or
      ``attention`` attribute that is a plain callable, not a submodule, as on
      ``uu.SelfAttention``) is wrapped to run inside :func:`~ipu_unit_scaling.fp8.fp8_attention`:
      the ``F.scaled_dot_product_attention`` it calls (``U.scaled_dot_product_attention`` calls
      it too, keeping its unit scaling around it) runs its two matmuls in FP8. Casts are
      recorded under each module's qualified name in :func:`~ipu_unit_scaling.fp8.fp8_stats`.
    - `simulate_fp8(model, "mx")`: a recipe name (a key of
      :data:`~ipu_unit_scaling.fp8.fp8_config.RECIPES`) is its config,
      ``FP8Config.from_recipe("mx")``.
    """
    if config is None:
        return simulate_format(module, FPFormat(4, 3), FPFormat(5, 2))
    if isinstance(config, str):
        config = FP8Config.from_recipe(config)  # FP8ConfigError (one line) for another name
    elif not isinstance(config, FP8Config):
        raise TypeError(f"simulate_fp8: config must be an FP8Config or a recipe name, not "
                        f"{type(config).__name__}")
    root = _fp8_version(module, config, "linear")
    if root is not None:
        return cast(M, root)
    converted = False
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            site = f"{parent_name}.{child_name}" if parent_name else child_name
            replacement = _fp8_version(child, config, site)
            if replacement is not None:
                setattr(parent, child_name, replacement)
                converted = True
    if converted:
        mark_converted(module, "FP8")
    if config.attention:
        for name, submodule in module.named_modules():
            for attribute in _ATTENTION_ATTRIBUTES:
                fn = getattr(submodule, attribute, None)
                if callable(fn) and not isinstance(fn, (nn.Module, FP8AttentionFn)):
                    setattr(submodule, attribute, FP8AttentionFn(fn, config, name or "attention"))
    return module


# Attribute names under which modules keep their attention function.
_ATTENTION_ATTRIBUTES = ("attention_fn", "attention")


def _fp8_version(module: nn.Module, config: FP8Config, site: str) -> Optional[nn.Module]:
    if isinstance(module, FP8Linear):
        return None  # already converted
    if isinstance(module, UnitConv1D):
        return FP8UnitScaledConv1D.from_unit_conv1d(module, CONSTRAINT, config, site)
    if is_conv1d(module):
        return FP8Conv1D.from_conv1d(module, config, site)
    if isinstance(module, nn.Linear) and hasattr(module, "constraint"):
        return FP8UnitScaledLinear.from_unit_scaled(module, config, site)
    if type(module) is nn.Linear:
        return FP8Linear.from_linear(module, config, site)
    return None
