"""The package's PopART custom ops on the PopTorch stand-in, as any op library's would run.

On an IPU, ``custom_ops/`` builds a library that registers ``Fp8Quantise``,
``Fp8GradientQuantise``, ``Fp8GroupQuantise``, ``Fp8GroupGradientQuantise``,
``ScaledIdentity`` and ``Fp8AmaxCast`` (domain ``ai.graphcore.unit_scaling``) with PopART, and
the IPU backend calls them through ``poptorch.custom_op``. The stand-in has no PopART:
:func:`register_with_standin` gives it their host numerics instead
(:mod:`ipu_standins.poptorch_custom_ops`), the package's ``torch.library`` ops, which compute
what the PopART ops compute. ``Fp8GroupQuantise`` (the grouped recipes: rowwise, block, MX) is
``ipu_unit_scaling::fp8_group_quantise``, which runs its codelets tile by tile
(:mod:`ipu_unit_scaling.fp8.codelet_blocks`); ``Fp8GroupGradientQuantise``, the identity whose
gradient that op casts, is ``ipu_unit_scaling::fp8_group_quantise_gradient``
(:mod:`ipu_unit_scaling.fp8.group_cast_ops`). Importing this module
registers them, so that naming it in ``$POPTORCH_STANDIN_OP_LIBRARIES`` (as ``ipu-unit-scaling
emulate`` does) gives a program's subprocesses the same ops.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ipu_standins import poptorch_custom_ops

from ..fp8.codelet_blocks import GROUP_QUANTISE_OP
from ..fp8.group_cast_ops import GROUP_GRADIENT_QUANTISE_OP
from .poptorch.fp8_custom_op import (
    DOMAIN,
    GRADIENT_QUANTISE_OP,
    OP_NAME,
    QUANTISE_OP,
    SCALED_IDENTITY_OP,
)

__all__ = ["register_with_standin", "LIBRARY_MODULE", "HOST_TORCH_OPS"]

LIBRARY_MODULE = __name__  # what $POPTORCH_STANDIN_OP_LIBRARIES names
# PopART op name -> the torch.library op with its numerics (Fp8AmaxCast has none: a function).
HOST_TORCH_OPS = {
    QUANTISE_OP: "ipu_unit_scaling::fp8_quantise",
    GRADIENT_QUANTISE_OP: "ipu_unit_scaling::fp8_quantise_gradient",
    SCALED_IDENTITY_OP: "ipu_unit_scaling::scaled_identity",
    GROUP_QUANTISE_OP: "ipu_unit_scaling::fp8_group_quantise",
    GROUP_GRADIENT_QUANTISE_OP: "ipu_unit_scaling::fp8_group_quantise_gradient",
}


def _scale(attributes: Dict[str, Any]) -> Optional[int]:
    return int(attributes["log2_scale"]) if attributes.get("has_log2_scale") else None


def _quantise(inputs: List[torch.Tensor], attributes: Dict[str, Any]) -> List[torch.Tensor]:
    return [torch.ops.ipu_unit_scaling.fp8_quantise(
        inputs[0], attributes["format"], int(attributes["margin"]),
        bool(attributes["saturate"]), _scale(attributes))]


def _quantise_gradient(inputs: List[torch.Tensor], attributes: Dict[str, Any]
                       ) -> List[torch.Tensor]:
    return [torch.ops.ipu_unit_scaling.fp8_quantise_gradient(
        inputs[0], attributes["format"], int(attributes["margin"]),
        bool(attributes["saturate"]), _scale(attributes))]


def _scaled_identity(inputs: List[torch.Tensor], attributes: Dict[str, Any]
                     ) -> List[torch.Tensor]:
    return [torch.ops.ipu_unit_scaling.scaled_identity(
        inputs[0], float(attributes["fwd_scale"]), float(attributes["bwd_scale"]))]


def _amax_cast(inputs: List[torch.Tensor], attributes: Dict[str, Any]) -> List[torch.Tensor]:
    from ..fp8 import cast_to_fp8

    cast = cast_to_fp8(inputs[0], attributes["format"], log2_scale=_scale(attributes),
                       margin=int(attributes["margin"]),
                       overflow="saturate" if attributes["saturate"] else "nan")
    return [cast.codes, torch.tensor(cast.log2_scale, dtype=torch.int32),
            torch.tensor(0, dtype=torch.int32)]


def _group_attributes(attributes: Dict[str, Any]) -> Tuple[Any, ...]:
    """The grouped ops' attributes with the PopART ops' defaults."""
    return (str(attributes.get("format", "F143")), str(attributes.get("grouping", "tile")),
            int(attributes.get("group_size", 128)), str(attributes.get("rule", "amax")),
            str(attributes.get("scale_rounding", "floor")), int(attributes.get("margin", 0)),
            bool(attributes.get("saturate", 1)))


def _group_quantise(inputs: List[torch.Tensor], attributes: Dict[str, Any]
                    ) -> List[torch.Tensor]:
    return list(torch.ops.ipu_unit_scaling.fp8_group_quantise(
        inputs[0], *_group_attributes(attributes)))


def _group_quantise_gradient(inputs: List[torch.Tensor], attributes: Dict[str, Any]
                             ) -> List[torch.Tensor]:
    return [torch.ops.ipu_unit_scaling.fp8_group_quantise_gradient(
        inputs[0], *_group_attributes(attributes))]


def register_with_standin() -> None:
    """Register the six ops' host numerics with the PopTorch stand-in (again: a no-op)."""
    from ..fp8 import cast_ops  # noqa: F401  (defines the torch.library ops)
    from ..ops import scaled_identity  # noqa: F401

    numerics = {QUANTISE_OP: _quantise, GRADIENT_QUANTISE_OP: _quantise_gradient,
                SCALED_IDENTITY_OP: _scaled_identity, GROUP_QUANTISE_OP: _group_quantise,
                GROUP_GRADIENT_QUANTISE_OP: _group_quantise_gradient}
    for name, function in numerics.items():
        poptorch_custom_ops.register_op(DOMAIN, name, function, torch_op=HOST_TORCH_OPS[name])
    poptorch_custom_ops.register_op(DOMAIN, OP_NAME, _amax_cast)


register_with_standin()
