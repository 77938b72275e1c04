"""One cast path for every FP8 recipe: a 2-D tensor cast with one scale per group.

A *grouping* says which elements share a scale, with the reduction dimension of the GEMM
that consumes the tensor as its last dimension:

- ``"tensor"``: all of them (the per-tensor recipes);
- ``"row"``: each row (``rowwise``);
- ``"tile"``: each 1 x ``size`` run of a row (``block``'s activations and gradients, ``mx``'s
  32-element and ``nvfp4``'s 16-element blocks);
- ``"block"``: each ``size`` x ``size`` square (``block``'s weights).

A *rule* says how a group's scale follows from its absolute maximum:

- ``"amax"``: the package's AMAX rule, ``s = clamp(floor(log2(fmt.max / amax)) - margin, -31,
  31)`` (0 for an all-zero group), the same as :func:`~.scaling.log2_scale` per tensor;
- ``"mx"``: OCP MX v1.0's E8M0 shared scale ``2**e`` with ``e = floor(log2(amax)) - emax``
  (``emax`` the element format's largest exponent; ``scale_rounding="floor"``), or the
  smallest ``e`` with ``amax <= fmt.max * 2**e`` (``"up"``: no element saturates), clamped
  to -127..127; an all-zero group gets ``e = -127``. In the package's convention ``s = -e``;
- ``"nvfp4"``: a float32 per-tensor scale ``g = amax(tensor) / (6 * 448)`` (1 for an all-zero
  tensor) and an E4M3 block scale ``d = E4M3(amax(block) / (6 * g))`` (round to nearest, each
  step in float32); the elements are ``E2M1(x / (d * g))`` and decode to ``e * (d * g)``. A
  block whose ``d`` is 0 decodes to zeros.

Edge cases, for every grouping and rule: a ragged last tile or block (a size that does not
divide by the group) is a smaller group: the cast pads it with zeros, which change no amax, and
drops the padding after. A group whose amax is inf or NaN raises
:class:`~.scaling.NonFiniteAmaxError` naming the first such group, whatever the overflow
policy: no scale can be chosen for it (MX would encode its scale as E8M0's NaN; this package
stops instead, as the per-tensor AMAX cast does). Elements round to nearest even (or
stochastically) and overflow by the config's policy; "mx" and "nvfp4" saturate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from .codec import check_choice, decode, decode_float8, encode
from .fp8_formats import E4M3FN, F143, F152, SUB_BYTE_FORMATS, FP8Format
from .scaling import MAX_LOG2_SCALE, NonFiniteAmaxError, check_margin
from .stats import record_cast, stats_enabled

__all__ = [
    "GROUPINGS", "SCALE_RULES", "Grouping", "GroupCast", "group_cast", "group_cast_pair",
    "group_log2_scales",
    "mx_shared_exponents", "MX_SCALE_LIMIT", "NVFP4_BLOCK_SCALE_MAX",
]

GROUPINGS = ("tensor", "row", "tile", "block")
SCALE_RULES = ("amax", "mx", "nvfp4")
MX_SCALE_LIMIT = 127  # E8M0 encodes 2**-127 .. 2**127 (code 255 is NaN)
NVFP4_BLOCK_SCALE_MAX = E4M3FN.max  # 448
_NVFP4_ELEMENT_MAX = 6.0  # E2M1's largest value


@dataclass(frozen=True)
class Grouping:
    """Which elements of a 2-D tensor share a scale (see the module docstring)."""

    kind: str
    size: int = 0

    def __post_init__(self) -> None:
        check_choice(self.kind, GROUPINGS, "grouping")
        if self.kind in ("tile", "block") and self.size < 1:
            raise ValueError(f"a {self.kind} grouping needs a size >= 1, got {self.size}")


class GroupCast(NamedTuple):
    """A grouped cast's result: the FP8 values (float32, ``x``'s shape), each group's
    ``log2_scales`` (``values ~= decode(codes) * 2**-s``; int32, one per group, shaped like the
    grouped view with the group's own axes of size 1), and for "nvfp4" the float32 block and
    tensor decode scales (``d`` and ``g``) instead."""

    values: torch.Tensor
    log2_scales: Optional[torch.Tensor]
    block_scales: Optional[torch.Tensor] = None
    tensor_scale: Optional[float] = None


def _grouped_view(x: torch.Tensor, grouping: Grouping) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """``x`` zero-padded and viewed so that each group is a slice over the returned axes."""
    rows, cols = x.shape
    if grouping.kind == "tensor":
        return x.reshape(1, rows * cols), (0, 1)
    if grouping.kind == "row":
        return x, (1,)
    size = grouping.size
    pad_cols = -cols % size
    pad_rows = -rows % size if grouping.kind == "block" else 0
    if pad_cols or pad_rows:
        x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
    if grouping.kind == "tile":
        return x.reshape(rows, -1, size), (2,)
    return x.reshape(x.shape[0] // size, size, -1, size), (1, 3)


def _ungroup(view: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    rows, cols = shape
    if view.dim() == 4:
        view = view.reshape(view.shape[0] * view.shape[1], -1)
    else:
        view = view.reshape(rows, -1)
    return view[:rows, :cols] if view.shape != shape else view


def _check_finite(amax: torch.Tensor, fmt: FP8Format) -> None:
    if bool(torch.isfinite(amax).all()):
        return
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        value = float(amax[index])
        raise NonFiniteAmaxError(
            f"the amax of the group at {index} is {value}; cannot choose an FP8 scale for "
            f"{fmt.name}")


def group_log2_scales(amax: torch.Tensor, fmt: FP8Format, margin: int) -> torch.Tensor:
    """The AMAX rule for a tensor of finite amaxes, exactly (from the binary exponents)."""
    max_mantissa, max_exponent = math.frexp(fmt.max)
    mantissa, exponent = torch.frexp(amax.to(torch.float32))
    scales = (max_exponent - margin) - exponent - (mantissa > max_mantissa).to(exponent.dtype)
    scales = scales.clamp_(-MAX_LOG2_SCALE, MAX_LOG2_SCALE)
    return scales.masked_fill_(amax == 0, 0).to(torch.int32)


def mx_shared_exponents(amax: torch.Tensor, fmt: FP8Format, rounding: str = "floor"
                        ) -> torch.Tensor:
    """OCP MX's E8M0 exponent ``e`` (int32) of each finite amax (see the module docstring)."""
    check_choice(rounding, ("floor", "up"), "scale rounding")
    mantissa, exponent = torch.frexp(amax.to(torch.float32))
    if rounding == "floor":
        shared = exponent - 1 - fmt.max_exponent  # floor(log2(amax)) = exponent - 1
    else:
        max_mantissa, max_exponent = math.frexp(fmt.max)
        shared = exponent - max_exponent + (mantissa > max_mantissa).to(exponent.dtype)
    shared = shared.clamp(-MX_SCALE_LIMIT, MX_SCALE_LIMIT)
    return torch.where(amax == 0, torch.full_like(shared, -MX_SCALE_LIMIT), shared).to(
        torch.int32)


def _powers_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """``2**exponents`` in float32, exact down to 2**-149 (computed in float64)."""
    return torch.exp2(exponents.to(torch.float64)).to(torch.float32)


# The host library rounds to F143 and F152. E4M3FN's grid is twice F143's and E5M2's twice
# F152's (one less exponent bias, same subnormal steps) up to the OCP format's max, so halving,
# clamping to max / 2 and doubling gives the OCP formats from the IPU ones, exactly.
_HOST_GRIDS = {"F143": (F143, 1.0), "F152": (F152, 1.0), "E4M3FN": (F143, 2.0),
               "E5M2": (F152, 2.0)}


def _host_grid(fmt: FP8Format, x: torch.Tensor) -> Optional[Tuple[Any, FP8Format, float]]:
    """(the host library, the IPU grid, its step) that round ``fmt`` for ``x`` in one pass,
    or None where the host library does not apply."""
    if fmt.name not in _HOST_GRIDS or x.device.type != "cpu":
        return None
    try:
        from . import host_library as _host
    except ImportError:
        return None
    if not _host.fused_cast_available():
        return None
    grid, step = _HOST_GRIDS[fmt.name]
    return _host, grid, step


def _host_kernel_args(fmt: FP8Format, x32: torch.Tensor, rule: str, margin: int,
                      scale_rounding: str) -> Optional[Tuple[Any, Tuple[Any, ...]]]:
    """(the host library, the block kernels' format and rule arguments) for ``x32``, or None
    where they do not apply."""
    host = _host_grid(fmt, x32)
    if host is None:
        return None
    return host[0], _kernel_format_args(fmt, rule, margin, scale_rounding)


def _kernel_format_args(fmt: FP8Format, rule: str, margin: int,
                        scale_rounding: str) -> Tuple[Any, ...]:
    """The block kernels' format and rule arguments for a format of ``_HOST_GRIDS``."""
    grid, step = _HOST_GRIDS[fmt.name]
    kernel_rule = "amax" if rule == "amax" else f"mx_{scale_rounding}"
    return (grid.name, kernel_rule, fmt.max, fmt.max_exponent, margin, 1 if step != 1.0 else 0)


def _grouped_scales(scales: torch.Tensor, grouping: Grouping) -> torch.Tensor:
    """The kernels' (bands, group columns) scales shaped as the torch path's grouped view."""
    if grouping.kind == "tile":
        return scales.unsqueeze(-1)
    if grouping.kind == "block":
        return scales.reshape(scales.shape[0], 1, scales.shape[1], 1)
    return scales


def _physical_groups(x32: torch.Tensor, grouping: Grouping
                     ) -> Tuple[torch.Tensor, int, int, bool]:
    """(the contiguous matrix a kernel reads, its groups' rows and columns, whether that is
    ``x32.t()``): a transposed view of a contiguous matrix (a GEMM operand cast along the other
    dimension) is read in its own layout with the groups turned, never copied."""
    rows, cols = x32.shape
    size = grouping.size
    shape = {"tensor": (rows, cols), "row": (1, cols), "tile": (1, size),
             "block": (size, size)}[grouping.kind]
    transposed = not x32.is_contiguous() and x32.t().is_contiguous()
    physical = x32.t() if transposed else x32.contiguous()
    group_rows, group_cols = (shape[1], shape[0]) if transposed else shape
    return physical, group_rows, group_cols, transposed


def _host_group_cast(x32: torch.Tensor, fmt: FP8Format, grouping: Grouping, rule: str,
                     margin: int, scale_rounding: str) -> Optional[GroupCast]:
    """The cast by the host library's block kernels (one call, no padding), or None where they
    do not apply or a group's amax is not finite (the torch path then names the group).

    A transposed view of a contiguous matrix (a GEMM operand cast along the other dimension)
    is rounded in place with column groups and returned as the transposed view of the values,
    so it is never copied into a transposed layout first.
    """
    if rule == "mx" and fmt.name in SUB_BYTE_FORMATS:
        return _host_mx_subbyte_cast(x32, fmt, grouping, scale_rounding)
    found = _host_kernel_args(fmt, x32, rule, margin, scale_rounding)
    if found is None:
        return None
    library, args = found
    physical, group_rows, group_cols, transposed = _physical_groups(x32, grouping)
    values, scales, finite = library.group_quantise(physical, group_rows, group_cols, *args)
    if not finite:
        return None
    if transposed:
        values, scales = values.t(), scales.t()
    return GroupCast(values, _grouped_scales(scales, grouping))


_PAIR_ARGS: Dict[Tuple[FP8Format, str, int, str], Optional[Tuple[Any, ...]]] = {}


def pair_arguments(fmt: FP8Format, rule: str, margin: int,
                   scale_rounding: str) -> Optional[Tuple[Any, ...]]:
    """The host library's pair kernel's format and rule arguments for ``group_cast_pair``'s
    tile casts with these fields (round to nearest, saturating), prepared once; None where
    the kernel does not make them (the host library off, a format it does not round,
    NVFP4)."""
    try:
        from . import host_library
    except ImportError:
        return None
    if not host_library.fused_cast_available():
        return None
    key = (fmt, rule, margin, scale_rounding)
    if key not in _PAIR_ARGS:
        _PAIR_ARGS[key] = (host_library.pair_kernel_args(
            *_kernel_format_args(fmt, rule, margin, scale_rounding))
            if fmt.name in _HOST_GRIDS and rule in ("amax", "mx") else None)
    return _PAIR_ARGS[key]


def host_pair_values(x: torch.Tensor, size: int, args: Tuple[Any, ...],
                     out: Optional[torch.Tensor] = None
                     ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The values of ``group_cast_pair(x, ...)`` with ``1 x size`` tiles (``size`` -1: whole
    rows) and the fields ``args`` stands for (:func:`pair_arguments`) for a 2-D float32 CPU
    ``x``, both in ``x``'s shape, by one call of a host library pair kernel, without the
    scales: the training step's form; ``out`` (contiguous float32, ``x``'s shape) takes the
    first. None where the kernel does not take ``x`` or a group's amax is not finite; the
    caller then takes ``group_cast_pair``, which says why."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.numel():
        return None
    from . import host_library

    return host_library.pair_values(x.detach().contiguous(), size, args, out)


def group_cast_pair(
    x: torch.Tensor,
    fmt: FP8Format,
    grouping: Grouping,
    rule: str = "amax",
    margin: int = 0,
    overflow: str = "saturate",
    rounding: str = "nearest",
    scale_rounding: str = "floor",
    generator: Optional[torch.Generator] = None,
    site: Optional[str] = None,
    site_t: Optional[str] = None,
) -> Tuple[GroupCast, GroupCast]:
    """``group_cast(x, ...)`` and ``group_cast(x.t(), ...)``: the casts of a GEMM operand
    along each of its dimensions (``site`` and ``site_t`` name them for the statistics).

    For "tile" and "row" groupings on the host library, one call rounds both (the second
    as a transposed view of its values): tiles from one read of ``x``, rows and columns from
    two; the results are those of the two ``group_cast`` calls, bit for bit.
    """
    if (x.dim() == 2 and grouping.kind in ("tile", "row") and rule != "nvfp4"
            and rounding == "nearest" and overflow == "saturate" and not stats_enabled()
            and x.numel()):
        check_choice(rule, SCALE_RULES, "scale rule")
        check_margin(margin)
        x32 = x.detach().to(torch.float32).contiguous()
        found = _host_kernel_args(fmt, x32, rule, margin, scale_rounding)
        if found is not None and grouping.kind == "row":
            library, args = found
            rows, row_scales, cols, col_scales, finite = library.rowwise_quantise_pair(
                x32, *args)
            if finite:
                return GroupCast(rows, row_scales), GroupCast(cols.t(), col_scales.t())
        elif found is not None:
            library, args = found
            rows, row_scales, cols, col_scales, finite = library.group_quantise_pair(
                x32, grouping.size, *args)
            if finite:
                return (GroupCast(rows, row_scales.unsqueeze(-1)),
                        GroupCast(cols.t(), col_scales.t().unsqueeze(-1)))
    common = dict(rule=rule, margin=margin, overflow=overflow, rounding=rounding,
                  scale_rounding=scale_rounding, generator=generator)
    return (group_cast(x, fmt, grouping, site=site, **common),  # type: ignore[arg-type]
            group_cast(x.t(), fmt, grouping, site=site_t, **common))  # type: ignore[arg-type]


def _round_elements(scaled: torch.Tensor, fmt: FP8Format, rounding: str, overflow: str,
                    generator: Optional[torch.Generator]) -> Tuple[torch.Tensor,
                                                               Optional[torch.Tensor]]:
    """(FP8 values of ``scaled`` in float32, their codes where the codec made them)."""
    dtype = fmt.torch_dtype
    if rounding == "nearest" and overflow == "saturate" and dtype is not None:
        # The codec's float8-dtype path for finite saturating input: a clamp and the cast.
        values = torch.clamp(scaled, -fmt.max, fmt.max)
        return decode_float8(values.to(dtype), fmt, out=values), None
    codes = encode(scaled, fmt, rounding=rounding, overflow=overflow, generator=generator)
    return decode(codes, fmt), codes


def group_cast(
    x: torch.Tensor,
    fmt: FP8Format,
    grouping: Grouping,
    rule: str = "amax",
    margin: int = 0,
    overflow: str = "saturate",
    rounding: str = "nearest",
    scale_rounding: str = "floor",
    log2_scale: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    site: Optional[str] = None,
) -> GroupCast:
    """Cast the 2-D tensor ``x`` to ``fmt`` with one scale per group (see the module docstring).

    ``log2_scale`` fixes the scale of a "tensor" grouping (the static and delayed recipes);
    otherwise each group's scale follows ``rule``. Returns the FP8 values as float32 in
    ``x``'s shape and the scales. Recorded by :func:`~.stats.fp8_stats` as one cast whose
    ``log2_scale`` is the smallest group scale (the one nearest to saturating).
    """
    if x.dim() != 2:
        raise ValueError(f"group_cast takes a 2-D tensor, got shape {tuple(x.shape)}")
    check_choice(rule, SCALE_RULES, "scale rule")
    check_margin(margin)
    x32 = x.detach().to(torch.float32)
    if x32.numel() == 0:
        return GroupCast(x32.clone(), torch.zeros((), dtype=torch.int32))
    if (log2_scale is None and rule != "nvfp4" and rounding == "nearest"
            and overflow == "saturate" and not stats_enabled()):
        fused = _host_group_cast(x32, fmt, grouping, rule, margin, scale_rounding)
        if fused is not None:
            return fused
    if rule == "nvfp4" and rounding == "nearest" and not stats_enabled():
        fused = _host_nvfp4_cast(x32, grouping)
        if fused is not None:
            return fused
    view, axes = _grouped_view(x32, grouping)
    if rule == "nvfp4":
        return _nvfp4_cast(x32, view, axes, fmt, rounding, generator, site)
    if log2_scale is not None:
        if grouping.kind != "tensor":
            raise ValueError("a fixed log2_scale needs the 'tensor' grouping")
        scales = torch.full([1] * view.dim(), log2_scale, dtype=torch.int32,
                            device=view.device)
    else:
        # (torch's vector_norm over some dimensions is ten times slower than this.)
        amax = torch.amax(view.abs(), dim=axes, keepdim=True)
        _check_finite(amax, fmt)
        if rule == "amax":
            scales = group_log2_scales(amax, fmt, margin)
        else:
            scales = -mx_shared_exponents(amax, fmt, scale_rounding)
    factors = _powers_of_two(scales)
    host = (_host_grid(fmt, view) if rounding == "nearest" and overflow == "saturate"
            else None)
    if host is not None:
        # The scale and the grid's step in one multiply each way (powers of two: exact).
        library, grid, step = host
        # (contiguous: a transposed operand's product keeps its strides, which the kernel
        # does not take)
        scaled = (view * (factors / step)).contiguous()
        if step != 1.0:
            scaled.clamp_(-fmt.max / step, fmt.max / step)
        values = library.quantise_float32(scaled, grid.name, 0, 0, True)[0]
        values.mul_(factors.reciprocal_().mul_(step))
        codes = None
    else:
        scaled = view * factors
        values, codes = _round_elements(scaled, fmt, rounding, overflow, generator)
        values.mul_(factors.reciprocal_())  # exact: powers of two down to 2**-149
    if stats_enabled():
        scaled = view * _powers_of_two(scales)
        if codes is None:
            codes = encode(scaled, fmt, rounding="nearest", overflow=overflow)
        record_cast(site, _ungroup(scaled, x32.shape), _ungroup(codes, x32.shape), fmt,
                    int(scales.min()))
    return GroupCast(_ungroup(values, x32.shape), scales)


def _subbyte_library(x32: torch.Tensor) -> Any:
    """The host library where its casts to FP4 and FP6 elements apply to ``x32``, else None."""
    if x32.device.type != "cpu":
        return None
    try:
        from . import host_library
    except ImportError:
        return None
    return host_library if host_library.fused_cast_available() else None


def _host_mx_subbyte_cast(x32: torch.Tensor, fmt: FP8Format, grouping: Grouping,
                          scale_rounding: str) -> Optional[GroupCast]:
    """MX's cast to FP4 or FP6 elements by the host library's kernel, the torch path's values
    and scales bit for bit, or None where it does not apply or an element is not finite (the
    torch path then names the group)."""
    host_library = _subbyte_library(x32)
    if host_library is None:
        return None
    physical, group_rows, group_cols, transposed = _physical_groups(x32, grouping)
    found = host_library.mx_subbyte_quantise(
        physical, group_rows, group_cols, fmt.mantissa_bits, fmt.min_exponent, fmt.max,
        fmt.max_exponent, scale_rounding == "up")
    if found is None:
        return None
    values, scales = found
    if transposed:
        values, scales = values.t(), scales.t()
    return GroupCast(values, _grouped_scales(scales, grouping))


def _host_nvfp4_cast(x32: torch.Tensor, grouping: Grouping) -> Optional[GroupCast]:
    """The NVFP4 cast by the host library's kernel, the torch path's values and scales bit
    for bit, or None where it does not apply (no host library, not on the CPU) or refuses (a
    non-finite amax, a tensor scale that underflows: the torch path then raises or rounds)."""
    host_library = _subbyte_library(x32)
    if host_library is None:
        return None
    physical, group_rows, group_cols, transposed = _physical_groups(x32, grouping)
    found = host_library.nvfp4_quantise(physical, group_rows, group_cols)
    if found is None:
        return None
    values, block_scales, tensor_scale = found
    if transposed:
        values, block_scales = values.t(), block_scales.t()
    return GroupCast(values, None, _grouped_scales(block_scales, grouping), tensor_scale)


def _nvfp4_cast(x32: torch.Tensor, view: torch.Tensor, axes: Tuple[int, ...], fmt: FP8Format,
                rounding: str, generator: Optional[torch.Generator],
                site: Optional[str]) -> GroupCast:
    tensor_amax = float(x32.abs().max())
    if not math.isfinite(tensor_amax):
        raise NonFiniteAmaxError(f"the tensor's amax is {tensor_amax}; cannot choose an "
                                 f"NVFP4 scale")
    amax = torch.amax(view.abs(), dim=axes, keepdim=True)
    top = torch.tensor(_NVFP4_ELEMENT_MAX * NVFP4_BLOCK_SCALE_MAX, dtype=torch.float32)
    tensor_scale = (torch.tensor(tensor_amax, dtype=torch.float32) / top
                    if tensor_amax > 0 else torch.ones((), dtype=torch.float32))
    wanted = amax / (_NVFP4_ELEMENT_MAX * tensor_scale)
    block = torch.clamp(wanted, max=NVFP4_BLOCK_SCALE_MAX).to(torch.float32)
    block = decode(encode(block, E4M3FN), E4M3FN)  # round to nearest E4M3 (saturating)
    decode_scale = block * tensor_scale
    safe = torch.where(decode_scale == 0, torch.ones_like(decode_scale), decode_scale)
    scaled = view / safe
    values, codes = _round_elements(scaled, fmt, rounding, "saturate", generator)
    if stats_enabled():
        if codes is None:
            codes = encode(scaled, fmt, rounding="nearest")
        record_cast(site, _ungroup(scaled, x32.shape), _ungroup(codes, x32.shape), fmt, 0)
    values = values * decode_scale
    return GroupCast(_ungroup(values, x32.shape), None, block, float(tensor_scale))
