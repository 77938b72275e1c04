"""An FP8 linear's GEMM-operand casts as the C++ layer nodes make them (`ops.native_layers`).

A GPT layer's two Functions (`fused_blocks.norm_qkv`, `fused_blocks.proj_norm_mlp`) run as C++
autograd nodes for float linears; with FP8 linears they can too, when the nodes can make each
cast themselves by calling the host library's kernels. :func:`layer_casts` describes one
linear's three casts (input, weight, output gradient) as the nodes take them:

- ``[1, fallback, exponent bits, saturate, has scale, log2 scale, margin]``: the per-tensor
  cast of `values.quantise_values` (``ius_fused_quantise``);
- ``[3, fallback, group rows, group columns, the same for the second cast, *kernel
  arguments]``: a grouped recipe's casts of an operand along its rows and along its columns
  by the group kernel (``ius_group_quantise``, as `group_cast.group_cast` calls it), the
  groups given in the operand's layout, -1 for a whole dimension, (0, 0) where the first
  cast serves both GEMMs (square weight blocks);
- ``[2, ...]``: the same, both casts by one call of a pair kernel, as
  `recipe_linear.grouped_operand_values` calls it: both tile casts from one read
  (``ius_group_quantise_pair``), or, for groups of whole rows (group columns -1), the
  per-row and per-column casts from two (``ius_rowwise_quantise_pair``);
- ``[4, fallback, exponent bits, saturate, margin, format max, reduce by max, update,
  history, role]``: the delayed recipe's per-tensor cast (`recipe_linear.role_cast` with
  `recipe_linear.delayed_log2_scale`): the scale from the role's row of the amax history the
  nodes hold at index ``history`` (:func:`held_history`), the operand's amax pushed into that
  row first where ``update`` is set, then ``ius_fused_quantise`` with that scale;
- ``[5, fallback, group rows, group columns, the same for the second cast]``: NVFP4's
  casts (``ius_nvfp4_quantise``, as `group_cast.group_cast` calls it), groups as for kind 3;
- ``[6, fallback, the groups as for kind 5, mantissa bits, smallest normal exponent, format
  max, emax, round up]``: MX's casts to FP4 or FP6 elements (``ius_mx_subbyte_quantise``);
- ``[0, fallback]``: a cast the kernels do not make here (stochastic rounding, a GEMM kept
  in float32).

``fallback`` numbers the Python quantiser that the nodes call for kind 0, and for any operand
that a kernel refuses (a non-finite amax, a shape it does not take): that makes the cast as
the Python Function would, or raises its error. The values are those of the Python Functions
bit for bit: the same kernels with the same arguments.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .fp8_config import FP8Config
from .fp8_formats import SUB_BYTE_FORMATS, FP8Format
from .recipe_linear import group_kernel_casts, pair_kernel_casts
from .values import values_path

__all__ = ["OperandCast", "layer_casts", "held_history"]

# (operand, transposed, out) -> (values, values for the transposed GEMM or None)
OperandCast = Callable[[torch.Tensor, bool, Optional[torch.Tensor]],
                       Tuple[torch.Tensor, Optional[torch.Tensor]]]
Spec = List[float]

ROLES = ("input", "weight", "grad_output")
_fallbacks: List[OperandCast] = []
_specs: Dict[Tuple[FP8Config, str, bool, int, bool], Tuple[Spec, Spec, Spec]] = {}
_registered: List[object] = []  # the native module the kernels were handed to
# Delayed linears' amax histories held by the native module: id(history) -> its index there.
# (The module holds each for the life of the process, so an id is never reused.)
_histories: Dict[int, int] = {}


def _fallback(index: int, x: torch.Tensor, transposed: bool,
              out: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    return _fallbacks[index](x, transposed, out)


def _register(module: object) -> bool:
    """Hand the kernels' addresses and :func:`_fallback` to the native module, once."""
    if module in _registered:
        return True
    from . import host_library

    lib = host_library.library()
    address = ctypes.cast(lib.ius_fused_quantise, ctypes.c_void_p).value
    pair_address = ctypes.cast(lib.ius_group_quantise_pair, ctypes.c_void_p).value
    group_address = ctypes.cast(lib.ius_group_quantise, ctypes.c_void_p).value
    amax_address = ctypes.cast(lib.ius_fused_amax, ctypes.c_void_p).value
    rowwise_address = ctypes.cast(lib.ius_rowwise_quantise_pair, ctypes.c_void_p).value
    nvfp4_address = ctypes.cast(lib.ius_nvfp4_quantise, ctypes.c_void_p).value
    mx_subbyte_address = ctypes.cast(lib.ius_mx_subbyte_quantise, ctypes.c_void_p).value
    module.set_fp8_casts(address, pair_address, group_address,  # type: ignore[attr-defined]
                         amax_address, rowwise_address, nvfp4_address, mx_subbyte_address,
                         _fallback)
    _registered.append(module)
    return True


def held_history(module: object, history: torch.Tensor) -> Optional[int]:
    """The index under which the native ``module`` holds the delayed recipe's amax
    ``history`` (handed to it on first sight), or None where its casts cannot read it there
    (not a contiguous CPU float32 tensor)."""
    index = _histories.get(id(history))
    if index is not None:
        return index
    if (history.device.type != "cpu" or history.dtype != torch.float32 or history.dim() != 2
            or history.shape[0] != len(ROLES) or not history.is_contiguous()):
        return None
    index = _histories[id(history)] = module.hold_history(history)  # type: ignore[attr-defined]
    return index


def _spec(config: FP8Config, role: str, log2_scale: Optional[int], fallback: int,
          history: int = -1, update: bool = False) -> Spec:
    fmt = _role_format(config, role)
    if config.scaling == "delayed":
        if config.rounding != "nearest" or values_path(fmt) != "host" or history < 0:
            return [0, fallback]
        from . import host_library

        return [4, fallback, host_library.exponent_bits(fmt.name),
                int(config.overflow == "saturate"), _role_margin(config, role), fmt.max,
                int(config.amax_reduction == "max"), int(update), history, ROLES.index(role)]
    subbyte_mx = config.scaling == "mx" and fmt.name in SUB_BYTE_FORMATS
    if config.scaling == "nvfp4" or subbyte_mx:
        if config.rounding != "nearest" or (config.grad_weight_high_precision
                                            and role != "weight"):
            return [0, fallback]
        size = config.group_size or 0
        if not subbyte_mx:
            return [5, fallback, 1, size, size, 1]
        return [6, fallback, 1, size, size, 1, fmt.mantissa_bits, fmt.min_exponent, fmt.max,
                fmt.max_exponent, int(config.scale_rounding == "up")]
    if config.grouped:
        groups = group_kernel_casts(config, role)
        if groups is None:
            return [0, fallback]
        along_rows, along_columns, args = groups
        pair = pair_kernel_casts(config, role) is not None
        return [2 if pair else 3, fallback, *along_rows, *along_columns, *args]
    if config.rounding != "nearest" or values_path(fmt) != "host":
        return [0, fallback]
    from . import host_library

    return [1, fallback, host_library.exponent_bits(fmt.name),
            int(config.overflow == "saturate"), int(log2_scale is not None), log2_scale or 0,
            _role_margin(config, role)]


def layer_casts(config: FP8Config, site: str, log2_scale: Optional[int],
                cast_for: Callable[[str], OperandCast],
                history: Optional[torch.Tensor] = None, update: bool = False
                ) -> Optional[Tuple[Spec, Spec, Spec]]:
    """The (input, weight, grad_output) casts of the linear at ``site`` for the C++ layer
    nodes, or None where they cannot run: the nodes or the host library are not built or
    are off. ``log2_scale``: a per-tensor recipe's fixed scale (None: from the amax);
    ``cast_for(role)``: the linear's Python cast for ``role``, their fallback; ``history``
    and ``update``: the delayed recipe's amax history, and whether the casts push into it."""
    from . import host_library

    available = host_library.fused_cast_available()
    key = (config, site, available, -1 if history is None else id(history), update)
    found = _specs.get(key)
    if found is not None:
        return found
    if not available:
        return None
    from ..ops import native_layers

    module = native_layers.module()
    if module is None or not hasattr(module, "hold_history") or not _register(module):
        return None
    held = -1
    if history is not None:
        index = held_history(module, history)
        held = -1 if index is None else index
    specs: List[Spec] = []
    for role in ROLES:
        _fallbacks.append(cast_for(role))
        specs.append(_spec(config, role, log2_scale, len(_fallbacks) - 1, held, update))
    _specs[key] = (specs[0], specs[1], specs[2])
    return _specs[key]


def _role_format(config: FP8Config, role: str) -> FP8Format:
    return {"input": config.activation, "weight": config.weight,
            "grad_output": config.gradient}[role]


def _role_margin(config: FP8Config, role: str) -> int:
    return {"input": config.activation_margin, "weight": config.weight_margin,
            "grad_output": config.gradient_margin}[role]
