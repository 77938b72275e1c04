"""Run the grouped-recipe codelets on the host, tile by tile, as the ``Fp8GroupQuantise``
custom op's graph runs them.

The rowwise, block and MX recipes scale each group of a 2-D tensor (a row, a 1 x n tile of a
row, an n x n block: :class:`~.group_cast.Grouping`) by its own amax. On the IPU
(``codelets/fp8_block_codelets.cpp``, ``custom_ops/fp8_group_quantise.cpp``) each group lies
whole on one tile, so its amax is the tile-local amax and nothing is reduced across tiles::

    every tile:  GroupCastToFp8<T, E, S, Ocp>   its groups' segments -> codes, s and a
                                                non-finite flag per group
    every tile:  GroupCastFromFp8<T, E, Ocp>    codes, s -> decode(codes) * 2**-s

The groups, in row-major order of the grouped view (for n x n blocks: block row, block
column), are dealt to the tiles in contiguous runs that differ by at most one group, and a
tile's workers take whole groups the same way. A group lies in the tile's memory as its row
pieces (*segments*), each in a buffer of its own that starts on an 8-element boundary, as the
graph lays them out. The vertices are the C++ sources compiled for the host
(``_fp8_host.so``); their results equal :func:`~.group_cast.group_cast`'s bit for bit.

Formats: F143 and F152, and OCP E4M3FN and E5M2, held as the IPU code of half the value (the
OCP grids are twice the IPU ones up to their max, and saturate). Rules: ``"amax"`` with a margin,
``"mx"`` with ``scale_rounding`` ``"floor"`` or ``"up"``. NVFP4 and the FP4/FP6 elements have
no IPU form. As on the IPU, a group whose amax is inf or NaN does not raise: its ``s`` is 0 and
its non-finite flag is set.
"""
from __future__ import annotations

import ctypes
from typing import Any, Dict, Iterator, List, NamedTuple, Tuple

import numpy as np
import torch

from ..ops.op_library import LIBRARY
from ..ops.op_library import below_autograd as _below_autograd
from . import host_library as _host
from .codec import check_choice
from .codelets_on_host import PaddedBuffer
from .fp8_formats import FP8Format, get_format
from .group_cast import MX_SCALE_LIMIT, Grouping, group_cast
from .scaling import check_margin

__all__ = [
    "GROUP_QUANTISE_OP", "ELEMENT_GRIDS", "GroupLayout", "GroupCodes",
    "deal_groups", "group_scale_shape", "group_layout", "fp8_group_quantise",
    "group_cast_to_fp8_vertices", "group_cast_from_fp8_vertices", "group_quantise_graph",
]

GROUP_QUANTISE_OP = "Fp8GroupQuantise"  # the PopART op (domain ai.graphcore.unit_scaling)


def _rule_code(rule: str, scale_rounding: str) -> int:
    """The vertices' code of a scale rule: the host kernels' (:data:`.host_library.GROUP_RULES`)."""
    key = "amax" if (rule, scale_rounding) == ("amax", "floor") else f"{rule}_{scale_rounding}"
    if rule not in ("amax", "mx") or key not in _host.GROUP_RULES:
        raise ValueError(f"the IPU's grouped casts take rule 'amax' (scale_rounding 'floor') or "
                         f"'mx' ('floor' or 'up'), not {rule!r} with {scale_rounding!r}")
    return _host.GROUP_RULES[key]
# format name -> (exponent bits of the IPU grid, whether the OCP format on it)
ELEMENT_GRIDS = {"F143": (4, 0), "F152": (5, 0), "E4M3FN": (4, 1), "E5M2": (5, 1)}
_GRAIN = 8  # ius::kPartitionGrain: each segment's buffer starts on an 8-element boundary
_DEFAULT_TILES = 1472  # a Mk2 IPU (GC200)
_DEFAULT_WORKERS = 6

_c_void_p = ctypes.c_void_p
_c_int64 = ctypes.c_int64
_SIGNATURES: Dict[str, Tuple[Any, List[Any]]] = {
    "ius_group_plan": (ctypes.c_int, [_c_int64, _c_int64, ctypes.c_int, _c_int64, _c_void_p,
                                      _c_void_p, _c_void_p, _c_void_p, _c_void_p]),
    "ius_vertex_group_cast_to_fp8": (ctypes.c_int, [
        _c_void_p, _c_void_p, _c_void_p, _c_int64, _c_void_p, _c_int64, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint,
        _c_void_p, _c_void_p]),
    "ius_vertex_group_cast_from_fp8": (ctypes.c_int, [
        _c_void_p, _c_void_p, _c_void_p, _c_int64, _c_void_p, _c_int64, _c_void_p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint]),
}


def _vertex(name: str) -> Any:
    lib = _host.library()
    try:
        function = getattr(lib, name)
    except AttributeError:
        raise _host.HostLibraryUnavailable(
            f"{_host.LIBRARY_PATH.name} predates {name}; rebuild it with "
            "`python setup.py build_ext --inplace`") from None
    function.restype, function.argtypes = _SIGNATURES[name]
    return function


def deal_groups(groups: int, tiles: int) -> List[Tuple[int, int]]:
    """Each tile's run ``[first, end)`` of ``groups`` groups: ``ius::splitRange`` with a grain
    of one group, so runs differ by at most one group and the first tiles get the extra ones."""
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    base, extra = divmod(groups, tiles)
    runs = []
    for tile in range(tiles):
        first = tile * base + min(tile, extra)
        runs.append((first, first + base + (1 if tile < extra else 0)))
    return runs


class GroupLayout(NamedTuple):
    """The segments of a ``rows`` x ``cols`` tensor's groups, group after group."""

    rows: int
    cols: int
    scale_shape: Tuple[int, ...]  # the per-group scales, as group_cast shapes them
    starts: np.ndarray  # int64 [segments]: flat index of each segment's first element
    lengths: np.ndarray  # int64 [segments]
    group_ends: np.ndarray  # int64 [groups]: one past each group's last segment

    @property
    def groups(self) -> int:
        return int(self.group_ends.size)


_GROUP_KINDS = {"row": 0, "tile": 1, "block": 2}  # ius::kGroupRow, kGroupTile, kGroupBlock


def group_scale_shape(rows: int, cols: int, grouping: Grouping) -> Tuple[int, ...]:
    """The shape of a ``rows`` x ``cols`` tensor's per-group scales, as
    :func:`~.group_cast.group_cast` shapes them: the grouped view with the group's own axes of
    size 1."""
    if grouping.kind == "tensor":
        raise ValueError("a 'tensor' grouping is the per-tensor Fp8Quantise op, not a group op")
    if grouping.kind == "row":
        return (rows, 1)
    per_row = -(-cols // grouping.size)
    if grouping.kind == "tile":
        return (rows, per_row, 1)
    return (-(-rows // grouping.size), 1, per_row, 1)


def group_layout(rows: int, cols: int, grouping: Grouping) -> GroupLayout:
    """The groups of ``grouping`` ("row", "tile" or "block") over a ``rows`` x ``cols``
    tensor, ragged last groups included, in the order the graph deals them to tiles: the C++
    plan the custom op builds from (``ius::planGroups`` in ``codelets/placement.hpp``)."""
    shape = group_scale_shape(rows, cols, grouping)
    plan = _vertex("ius_group_plan")
    counts = np.zeros(2, dtype=np.int64)
    arguments = (rows, cols, _GROUP_KINDS[grouping.kind], grouping.size,
                 _address(counts, 0), _address(counts, 1))
    _check(plan(*arguments, None, None, None), "planGroups")
    starts, lengths = np.zeros(int(counts[0]), np.int64), np.zeros(int(counts[0]), np.int64)
    group_ends = np.zeros(int(counts[1]), np.int64)
    _check(plan(*arguments, _address(starts), _address(lengths), _address(group_ends)),
           "planGroups")
    return GroupLayout(rows, cols, shape, starts, lengths, group_ends)


class _SegmentMemory(PaddedBuffer):
    """Each segment in a buffer of its own starting on an 8-element boundary, as the graph
    allocates them; gathered from and scattered to the flat tensor."""

    def __init__(self, layout: GroupLayout):
        padded = layout.lengths + (-layout.lengths % _GRAIN)
        self.offsets = (np.cumsum(padded) - padded).astype(np.int64)
        total = int(padded.sum())
        within = np.arange(total, dtype=np.int64) - np.repeat(self.offsets, padded)
        index = np.repeat(layout.starts, padded) + within
        index[within >= np.repeat(layout.lengths, padded)] = -1
        super().__init__(index)
        self.lengths = np.ascontiguousarray(layout.lengths)

    def pointers(self, buffer: torch.Tensor) -> np.ndarray:
        return (buffer.data_ptr() + self.offsets * buffer.element_size()).astype(np.uint64)


def _address(array: np.ndarray, first: int = 0) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data + first * array.itemsize)


def _tile_runs(layout: GroupLayout, tiles: int) -> Iterator[Tuple[int, int, int, np.ndarray]]:
    """Per tile holding groups: (first group, end group, first segment, local group ends)."""
    for first, end in deal_groups(layout.groups, tiles):
        if end > first:
            segment = int(layout.group_ends[first - 1]) if first else 0
            ends = (layout.group_ends[first:end] - segment).astype(np.uint32)
            yield first, end, segment, ends


def _check(status: int, what: str) -> None:
    if status == _host.MISALIGNED:
        raise ValueError(f"{what}: a vertex field was connected to misaligned memory")
    if status != 0:
        raise ValueError(f"{what}: the host vertex rejected its arguments")


def _grid(fmt: FP8Format) -> Tuple[int, int]:
    if fmt.name not in ELEMENT_GRIDS:
        raise ValueError(f"the IPU's grouped casts take {', '.join(ELEMENT_GRIDS)} elements, "
                         f"not {fmt.name}")
    return ELEMENT_GRIDS[fmt.name]


def _input(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"the grouped casts take a 2-D tensor, got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"the codelets run on the host take CPU tensors, got {x.device}")
    _host.dtype_code(x.dtype)
    return x.detach().contiguous().reshape(-1)


class GroupCodes(NamedTuple):
    """What ``GroupCastToFp8`` writes: uint8 codes in x's shape, and per group (shaped as
    :func:`~.group_cast.group_cast` shapes its scales) the int32 ``log2_scales`` and the
    non-finite flags (bool)."""

    codes: torch.Tensor
    log2_scales: torch.Tensor
    non_finite: torch.Tensor


def group_cast_to_fp8_vertices(x: torch.Tensor, fmt: object, grouping: Grouping,
                               rule: str = "amax", margin: int = 0, overflow: str = "saturate",
                               scale_rounding: str = "floor", tiles: int = _DEFAULT_TILES,
                               workers: int = _DEFAULT_WORKERS) -> GroupCodes:
    """Run ``GroupCastToFp8`` on every tile holding groups of the 2-D float32/float16 ``x``."""
    fmt = get_format(fmt)  # type: ignore[arg-type]
    exponent_bits, ocp = _grid(fmt)
    check_choice(overflow, ("saturate", "nan"), "overflow policy")
    check_margin(margin)
    rule_code = _rule_code(rule, scale_rounding)
    if overflow != "saturate" and (ocp or rule == "mx"):
        raise ValueError(f"{fmt.name} elements and MX scales saturate: overflow must be "
                         f"'saturate', not {overflow!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    flat = _input(x)
    if flat.numel() == 0:  # no vertex runs; a group without elements has amax 0
        shape = group_scale_shape(x.shape[0], x.shape[1], grouping)
        empty_scale = 0 if rule == "amax" else MX_SCALE_LIMIT
        return GroupCodes(torch.zeros(x.shape, dtype=torch.uint8),
                          torch.full(shape, empty_scale, dtype=torch.int32),
                          torch.zeros(shape, dtype=torch.bool))
    layout = group_layout(x.shape[0], x.shape[1], grouping)
    memory = _SegmentMemory(layout)
    buffer = memory.gather(flat)
    codes = torch.zeros(buffer.numel(), dtype=torch.uint8)
    in_pointers, out_pointers = memory.pointers(buffer), memory.pointers(codes)
    scales = np.zeros(layout.groups, dtype=np.int32)
    flags = np.zeros(layout.groups, dtype=np.int32)
    vertex = _vertex("ius_vertex_group_cast_to_fp8")
    dtype = _host.dtype_code(flat.dtype)
    for first, end, segment, ends in _tile_runs(layout, tiles):
        status = vertex(_address(in_pointers, segment), _address(out_pointers, segment),
                        _address(memory.lengths, segment), int(ends[-1]), _address(ends),
                        end - first, dtype, exponent_bits, int(overflow == "saturate"), ocp,
                        rule_code, margin, workers,
                        _address(scales, first), _address(flags, first))
        _check(status, "GroupCastToFp8")
    return GroupCodes(memory.scatter(codes, flat.numel()).reshape(x.shape),
                      torch.from_numpy(scales).reshape(layout.scale_shape),
                      torch.from_numpy(flags).reshape(layout.scale_shape) != 0)


def group_cast_from_fp8_vertices(codes: torch.Tensor, log2_scales: torch.Tensor, fmt: object,
                                 grouping: Grouping, dtype: torch.dtype = torch.float32,
                                 tiles: int = _DEFAULT_TILES,
                                 workers: int = _DEFAULT_WORKERS) -> torch.Tensor:
    """Run ``GroupCastFromFp8`` on every tile holding groups: ``decode(codes) * 2**-s`` with
    each group's ``s``, as float32 or float16 (rounded to nearest even) in the codes' shape."""
    fmt = get_format(fmt)  # type: ignore[arg-type]
    exponent_bits, ocp = _grid(fmt)
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise TypeError(f"codes must be 2-D uint8, got {codes.dtype} of shape "
                        f"{tuple(codes.shape)}")
    if codes.numel() == 0:
        return torch.zeros(codes.shape, dtype=dtype)
    layout = group_layout(codes.shape[0], codes.shape[1], grouping)
    if log2_scales.numel() != layout.groups:
        raise ValueError(f"{layout.groups} groups need as many scales, got "
                         f"{log2_scales.numel()}")
    memory = _SegmentMemory(layout)
    buffer = memory.gather(codes.detach().contiguous().reshape(-1))
    out = torch.zeros(buffer.numel(), dtype=dtype)
    in_pointers, out_pointers = memory.pointers(buffer), memory.pointers(out)
    scales = np.ascontiguousarray(log2_scales.reshape(-1).numpy().astype(np.int32))
    vertex = _vertex("ius_vertex_group_cast_from_fp8")
    out_dtype = _host.dtype_code(dtype)
    for first, end, segment, ends in _tile_runs(layout, tiles):
        status = vertex(_address(in_pointers, segment), _address(out_pointers, segment),
                        _address(memory.lengths, segment), int(ends[-1]), _address(ends),
                        end - first, _address(scales, first), out_dtype, exponent_bits, ocp,
                        workers)
        _check(status, "GroupCastFromFp8")
    return memory.scatter(out, codes.numel()).reshape(codes.shape)


def group_quantise_graph(x: torch.Tensor, fmt: object, grouping: Grouping, rule: str = "amax",
                         margin: int = 0, overflow: str = "saturate",
                         scale_rounding: str = "floor", tiles: int = _DEFAULT_TILES,
                         workers: int = _DEFAULT_WORKERS) -> GroupCodes:
    """The ``Fp8GroupQuantise`` graph, vertex by vertex: ``decode(cast(x * 2**s)) * 2**-s``
    with each group's ``s``. Returns the values (x's dtype and shape) in place of the codes,
    the scales and the non-finite flags."""
    cast = group_cast_to_fp8_vertices(x, fmt, grouping, rule, margin, overflow, scale_rounding,
                                      tiles, workers)
    values = group_cast_from_fp8_vertices(cast.codes, cast.log2_scales, fmt, grouping, x.dtype,
                                          tiles, workers)
    return GroupCodes(values, cast.log2_scales, cast.non_finite)


# ---------------------------------------------------------------------------------------------
# The op's numerics as a torch.library op: one node of a traced graph (the PopTorch stand-in
# runs it for poptorch.custom_op), with the PopART op's straight-through gradient.

LIBRARY.define("fp8_group_quantise(Tensor x, str format, str grouping, int group_size, "
               "str rule, str scale_rounding, int margin, bool saturate) "
               "-> (Tensor, Tensor, Tensor)")


def _group_quantise_kernel(x: torch.Tensor, format: str, grouping: str, group_size: int,
                           rule: str, scale_rounding: str, margin: int, saturate: bool
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = Grouping(grouping, group_size)
    overflow = "saturate" if saturate else "nan"
    try:
        result = group_quantise_graph(x, format, groups, rule, margin, overflow, scale_rounding)
        return result.codes, result.log2_scales, result.non_finite.to(torch.int32)
    except _host.HostLibraryUnavailable:
        # group_cast gives the same bits, but raises on an inf/NaN group
        cast = group_cast(x, get_format(format), groups, rule=rule, margin=margin,
                          overflow=overflow, scale_rounding=scale_rounding)
        assert cast.log2_scales is not None
        return (cast.values.to(x.dtype), cast.log2_scales.to(torch.int32),
                torch.zeros_like(cast.log2_scales, dtype=torch.int32))


def _group_quantise_meta(x: torch.Tensor, format: str, grouping: str, group_size: int,
                         rule: str, scale_rounding: str, margin: int, saturate: bool
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = group_scale_shape(x.shape[0], x.shape[1], Grouping(grouping, group_size))
    return (torch.empty_like(x), x.new_empty(shape, dtype=torch.int32),
            x.new_empty(shape, dtype=torch.int32))


class _GroupQuantise(torch.autograd.Function):
    """The Autograd kernel: the values' gradient passes straight through, as the grad op's."""

    @staticmethod
    def forward(ctx, x, *attributes):  # type: ignore[override]
        with _below_autograd():
            values, scales, flags = torch.ops.ipu_unit_scaling.fp8_group_quantise(x, *attributes)
        ctx.mark_non_differentiable(scales, flags)
        ctx.attributes = len(attributes)
        return values, scales, flags

    @staticmethod
    def backward(ctx, grad, *_):  # type: ignore[override]
        return (grad,) + (None,) * ctx.attributes


def _group_quantise_autograd(x: torch.Tensor, format: str, grouping: str, group_size: int,
                             rule: str, scale_rounding: str, margin: int, saturate: bool
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _GroupQuantise.apply(x, format, grouping, group_size, rule,  # type: ignore[no-any-return]
                                scale_rounding, margin, saturate)


LIBRARY.impl("fp8_group_quantise", _group_quantise_kernel, "CPU")
LIBRARY.impl("fp8_group_quantise", _group_quantise_meta, "Meta")
LIBRARY.impl("fp8_group_quantise", _group_quantise_autograd, "Autograd")


def fp8_group_quantise(x: torch.Tensor, fmt: str, grouping: Grouping, rule: str = "amax",
                       margin: int = 0, saturate: bool = True, scale_rounding: str = "floor"
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.ipu_unit_scaling.fp8_group_quantise``: what ``Fp8GroupQuantise`` computes
    (values in x's dtype, int32 scales, int32 non-finite flags), one node when traced."""
    return torch.ops.ipu_unit_scaling.fp8_group_quantise(  # type: ignore[no-any-return]
        x, fmt, grouping.kind, grouping.size, rule, scale_rounding, margin, saturate)
