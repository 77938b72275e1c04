"""`simulate_format` / `simulate_fp8`: a copy of a module whose matmuls see their inputs cast to
a low-precision format, and their output gradients cast to another.

The casts are plain ones (no scaling bias): what unit scaling makes possible. Each
`F.linear` and `F.scaled_dot_product_attention` call of the captured forward graph (see
`compose`; nn modules are traced through, and so are this package's unit-scaled ops, whose
matmuls run on their unscaled inputs) gets its tensor inputs quantised in the forward pass to
`fwd_format`, and the gradient of its output quantised in the backward pass to `bwd_format`.
Everything else runs as before, in the input precision.

For FP8 with per-tensor scaling biases (FP8-AMAX), the IPU's casts and FP8 linear layers, see
:func:`ipu_unit_scaling.fp8.simulate_fp8`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..fp8.generic_formats import FPFormat
from .compose import Backend, apply_transform

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


_QUANTISED: Dict[Any, Callable[..., Tensor]] = {
    F.linear: _quantised_linear,
    F.scaled_dot_product_attention: _quantised_attention,
}


def _quantising_backend(fwd_format: FPFormat, bwd_format: FPFormat) -> Backend:
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
    precision: for the numerics, not for speed."""
    return apply_transform(module, _quantising_backend(fwd_format, bwd_format))


def simulate_fp8(module: M) -> M:
    """`simulate_format` with FP8: E4M3 in the forward pass, E5M2 in the backward pass (the
    IPU's F143 and F152 grids), stochastically rounded."""
    return simulate_format(module, FPFormat(4, 3), FPFormat(5, 2))
