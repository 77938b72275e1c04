"""Run the FP8 codelets on the host, tile by tile, as the Poplar graph runs them, and count
what that graph places on each tile.

The PopART custom ops (``custom_ops/fp8_graph.cpp``) build this graph for an input laid out
over the tiles by whatever op produced or consumes it (its *tile mapping*)::

    every tile holding input:  PartialAmax<T>      on its data   -> partials[tile, 0..workers)
    a tree over those tiles:   MaxPartials         on <= F partials of a group -> their amax
    its root:                  ScalingBias<E>      on <= F partials -> log2 scale, non-finite flag
    every tile holding input:  CastToFp8<T, E, S>  on its data   -> codes, laid out like x

and the ``Fp8Quantise`` op (and the grad op of ``Fp8GradientQuantise``) adds
``CastFromFp8<T, E>`` on every tile, back to x's dtype: see :func:`fp8_quantise_graph`. A tile
whose data lies in several regions of its memory runs the ``...Regions`` variant of a vertex. The
tree (F = ceil(sqrt(tiles holding input))) is the C++ plan the custom op builds from
(``codelets/placement.hpp``), and each MultiVertex picks its workers' share itself with the
C++ split (``codelets/partition.hpp``), so this module runs the vertex sources compiled for
the host (``_fp8_host.so``) over the graph's own split. It needs the host library (see
:func:`ipu_unit_scaling.fp8.host_library.fast_path_status`).

A tile mapping here is a list over tiles of the tile's regions, each region a tuple of
``(begin, end)`` intervals of the flattened tensor that lie one after the other in the tile's
memory (what Poplar's ``getSortedContiguousRegions`` returns). :func:`flat_mapping` is the
even split of the flat tensor; :func:`block_mapping` a matmul-like layout of a matrix.

:func:`graph_model` lists the vertices and edges the custom op adds for a mapping, and
:func:`flat_graph_model` those of the earlier graph, which copied the input into the flat
layout, cast it there and reduced every tile's partials on tile 0; :func:`tile_loads` counts
them per tile.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from . import host_library as _host
from .fp8_formats import FP8Format, get_format
from .scaling import MAX_LOG2_SCALE, NonFiniteAmaxError

__all__ = [
    "IPU_TILES", "IPU_WORKERS", "TileCast", "Interval", "Region", "TileMapping",
    "python_partition", "flat_mapping", "block_mapping", "check_mapping",
    "tile_ranges", "region_length", "AmaxTree", "amax_tree", "region_pieces", "leaf_tiles",
    "partial_amaxes",
    "scaling_bias_vertex", "AmaxReduction", "reduce_amax", "cast_to_fp8_vertices",
    "cast_from_fp8_vertices", "fp8_quantise_graph", "PaddedBuffer",
]

# A Mk2 IPU (GC200): 1472 tiles, 6 hardware worker threads per tile.
IPU_TILES = 1472
IPU_WORKERS = 6
_OVERFLOW_POLICIES = ("saturate", "nan")
_GRAIN = 8  # ius::kPartitionGrain: regions are allocated on 8-element boundaries here

Interval = Tuple[int, int]
Region = Tuple[Interval, ...]
TileMapping = List[List[Region]]


class TileCast(NamedTuple):
    """What the custom op's graph produces, plus the intermediate the tests look at."""

    codes: torch.Tensor  # uint8, shaped like the input
    log2_scale: int
    partials: Optional[torch.Tensor]  # float32 [tiles, workers]; None when the scale was given


# ---------------------------------------------------------------------------------------------
# The C++ placement rules, through the host library


_c_int64 = ctypes.c_int64
_c_void_p = ctypes.c_void_p
_PLACEMENT_SIGNATURES: Dict[str, Tuple[Any, List[Any]]] = {
    "ius_amax_tree": (_c_int64, [_c_void_p, _c_int64, ctypes.c_uint64, _c_int64, _c_void_p,
                                 _c_void_p, _c_void_p]),
    "ius_region_pieces": (ctypes.c_int, [_c_void_p, _c_int64, ctypes.c_uint, _c_void_p]),
    "ius_vertex_max_partials": (ctypes.c_int, [_c_void_p, _c_int64, _c_void_p]),
    "ius_vertex_partial_amax_regions": (
        ctypes.c_int, [_c_void_p, _c_void_p, _c_int64, ctypes.c_int, ctypes.c_uint, _c_void_p]),
    "ius_vertex_cast_to_fp8_regions": (
        ctypes.c_int, [_c_void_p, _c_void_p, _c_void_p, _c_int64, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_uint, ctypes.c_int]),
    "ius_vertex_cast_from_fp8_regions": (
        ctypes.c_int, [_c_void_p, _c_void_p, _c_void_p, _c_int64, ctypes.c_int, ctypes.c_int,
                       ctypes.c_uint, ctypes.c_int]),
}


def _function(name: str) -> Callable[..., int]:
    """An entry point of the host library that ``_host`` does not declare, typed here."""
    lib = _host.library()
    try:
        function = getattr(lib, name)
    except AttributeError:
        raise _host.HostLibraryUnavailable(
            f"{_host.LIBRARY_PATH.name} predates {name}; rebuild it with "
            "`python setup.py build_ext --inplace`") from None
    restype, argtypes = _PLACEMENT_SIGNATURES[name]
    function.restype = restype
    function.argtypes = argtypes
    return function  # type: ignore[no-any-return]


class AmaxTree(NamedTuple):
    """The reduction of the tiles' partials, as ``ius::planAmaxTree`` plans it.

    Nodes ``[0, leaves)`` are the PartialAmax vertices, in the order of the tiles given; the
    others are MaxPartials vertices, level by level, and last the root, ScalingBias.
    """

    tiles: List[int]  # node -> tile of its vertex
    parents: List[int]  # node -> the node that reads its result; -1 for the root
    levels: List[int]  # node -> 0 for leaves, then 1, 2, ... up to the root
    leaves: int

    @property
    def root(self) -> int:
        return len(self.tiles) - 1

    def children(self) -> List[List[int]]:
        children: List[List[int]] = [[] for _ in self.tiles]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                children[parent].append(node)
        return children


def amax_tree(leaf_tiles: Sequence[int], rotation: int = 0) -> AmaxTree:
    """The C++ amax tree over the tiles holding input (``rotation``: the op's id)."""
    leaves = len(leaf_tiles)
    capacity = 2 * leaves + 1
    tiles_in = np.asarray(leaf_tiles, dtype=np.uint32)
    tiles = np.zeros(capacity, dtype=np.int64)
    parents = np.zeros(capacity, dtype=np.int64)
    levels = np.zeros(capacity, dtype=np.int64)
    nodes = _function("ius_amax_tree")(
        tiles_in.ctypes.data, leaves, rotation, capacity, tiles.ctypes.data,
        parents.ctypes.data, levels.ctypes.data)
    if nodes < 1:
        raise ValueError(f"the amax tree over {leaves} tiles could not be planned")
    return AmaxTree(tiles[:nodes].tolist(), parents[:nodes].tolist(), levels[:nodes].tolist(),
                    leaves)


def region_pieces(lengths: Sequence[int], workers: int = IPU_WORKERS) -> torch.Tensor:
    """int64 ``[workers, regions, 2]``: the [begin, end) of each region each worker of a
    ``...Regions`` vertex takes (``ius::forEachPiece``); begin == end where it takes none."""
    count = len(lengths)
    lengths_in = np.asarray(lengths, dtype=np.int64)
    pieces = np.zeros((workers, count, 2), dtype=np.int64)
    status = _function("ius_region_pieces")(lengths_in.ctypes.data, count, workers,
                                            pieces.ctypes.data)
    if status != 0:
        raise ValueError(f"bad region split: lengths={list(lengths)}, workers={workers}")
    return torch.from_numpy(pieces)


def _split(length: int, parts: int, part: int, grain: int) -> Tuple[int, int]:
    grains = -(-length // grain)
    base, extra = divmod(grains, parts)
    first = part * base + min(part, extra)
    last = first + base + (1 if part < extra else 0)
    return min(first * grain, length), min(last * grain, length)


def python_partition(numel: int, tiles: int = IPU_TILES, workers: int = IPU_WORKERS,
                     grain: int = 8) -> torch.Tensor:
    """A Python copy of the C++ partition, for reading and for checking the two agree."""
    bounds = torch.empty((tiles, workers, 2), dtype=torch.int64)
    for t in range(tiles):
        tile_begin, tile_end = _split(numel, tiles, t, grain)
        for w in range(workers):
            begin, end = _split(tile_end - tile_begin, workers, w, grain)
            bounds[t, w, 0] = tile_begin + begin
            bounds[t, w, 1] = tile_begin + end
    return bounds


# ---------------------------------------------------------------------------------------------
# Tile mappings


def tile_ranges(numel: int, tiles: int) -> List[Tuple[int, int]]:
    """[begin, end) of each tile's slice of the even split."""
    bounds = _host.partition(numel, tiles, 1)
    return [(int(b), int(e)) for b, e in bounds[:, 0].tolist()]


def flat_mapping(numel: int, tiles: int = IPU_TILES) -> TileMapping:
    """The even split of the flat tensor: tile t holds one region, its slice of the C++
    partition (:func:`ipu_unit_scaling.fp8.host_library.partition`)."""
    return [[((begin, end),)] if end > begin else [] for begin, end in tile_ranges(numel, tiles)]


def block_mapping(rows: int, cols: int, row_blocks: int, col_blocks: int,
                  tiles: int = IPU_TILES, contiguous_blocks: bool = True) -> TileMapping:
    """A matmul-like layout of a row-major ``[rows, cols]`` matrix: a grid of
    ``row_blocks x col_blocks`` blocks (rows split evenly, columns in 8-column grains), block
    ``(i, j)`` on tile ``i * col_blocks + j``.

    With ``contiguous_blocks`` each block is one region of its tile's memory, as when an op
    allocates its output block by block and presents it in row-major order; else each of the
    block's row segments is a region of its own.
    """
    if row_blocks * col_blocks > tiles:
        raise ValueError(f"{row_blocks} x {col_blocks} blocks need more than {tiles} tiles")
    mapping: TileMapping = [[] for _ in range(tiles)]
    for i in range(row_blocks):
        row_begin, row_end = _split(rows, row_blocks, i, 1)
        for j in range(col_blocks):
            col_begin, col_end = _split(cols, col_blocks, j, _GRAIN)
            if row_end == row_begin or col_end == col_begin:
                continue
            segments = tuple((r * cols + col_begin, r * cols + col_end)
                             for r in range(row_begin, row_end))
            tile = mapping[i * col_blocks + j]
            tile.extend([segments] if contiguous_blocks else [(s,) for s in segments])
    return mapping


def check_mapping(mapping: TileMapping, numel: int) -> None:
    """ValueError unless the mapping's intervals hold every element exactly once."""
    covered = np.zeros(numel, dtype=np.int64)
    for tile, regions in enumerate(mapping):
        for region in regions:
            if not region:
                raise ValueError(f"tile {tile} has an empty region")
            for begin, end in region:
                if not 0 <= begin < end <= numel:
                    raise ValueError(f"tile {tile}: interval [{begin}, {end}) is not a "
                                     f"non-empty part of [0, {numel})")
                covered[begin:end] += 1
    if numel and (covered.min() != 1 or covered.max() != 1):
        missing, doubled = int((covered == 0).sum()), int((covered > 1).sum())
        raise ValueError(f"the mapping leaves {missing} elements unmapped and maps {doubled} "
                         "more than once")


def region_length(region: Region) -> int:
    """The number of elements in a region (the sum of its intervals' lengths)."""
    return sum(end - begin for begin, end in region)


class PaddedBuffer:
    """A flat tensor's elements in a buffer with padding, as the graph allocates them:
    ``index[i]`` is the flat position of buffer element ``i``, -1 for padding."""

    def __init__(self, index: np.ndarray):
        self.index = torch.from_numpy(index)
        self.valid = self.index >= 0

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        buffer = torch.zeros(self.index.numel(), dtype=flat.dtype)
        buffer[self.valid] = flat[self.index[self.valid]]
        return buffer

    def scatter(self, buffer: torch.Tensor, numel: int) -> torch.Tensor:
        flat = torch.zeros(numel, dtype=buffer.dtype)
        flat[self.index[self.valid]] = buffer[self.valid]
        return flat


class _TileMemory(PaddedBuffer):
    """Each tile's regions as separate buffers, as Poplar allocates them (each region's
    buffer starts on an 8-element boundary), gathered from and scattered to a flat tensor."""

    def __init__(self, mapping: TileMapping):
        self.spans: List[List[Tuple[int, int]]] = []  # per tile: (offset, length) per region
        chunks: List[np.ndarray] = []
        size = 0
        for regions in mapping:
            spans = []
            for region in regions:
                length = region_length(region)
                spans.append((size, length))
                chunks.extend(np.arange(begin, end, dtype=np.int64) for begin, end in region)
                padding = -length % _GRAIN
                chunks.append(np.full(padding, -1, dtype=np.int64))
                size += length + padding
            self.spans.append(spans)
        super().__init__(np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64))

    def addresses(self, buffer: torch.Tensor, tile: int) -> Tuple[Any, Any, int]:
        """The tile's region pointers and lengths as ctypes arrays, and their count."""
        spans = self.spans[tile]
        pointers = (ctypes.c_void_p * len(spans))(
            *[buffer.data_ptr() + offset * buffer.element_size() for offset, _ in spans])
        lengths = (ctypes.c_int64 * len(spans))(*[length for _, length in spans])
        return pointers, lengths, len(spans)


def _mapping_for(numel: int, tiles: int, mapping: Optional[TileMapping]) -> TileMapping:
    if mapping is None:
        return flat_mapping(numel, tiles)
    check_mapping(mapping, numel)
    return mapping


# ---------------------------------------------------------------------------------------------
# Running the graph


def _flat_input(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise ValueError(f"the codelets run on the host take CPU tensors, got {x.device}")
    _host.dtype_code(x.dtype)
    return x.detach().contiguous().reshape(-1)


def _address(t: torch.Tensor, element: int = 0) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() + element * t.element_size())


def _check(status: int, what: str) -> None:
    if status == _host.MISALIGNED:
        raise ValueError(f"{what}: a vertex field was connected to misaligned memory")
    if status != 0:
        raise ValueError(f"{what}: the host vertex rejected its arguments")


def partial_amaxes(x: torch.Tensor, tiles: int = IPU_TILES, workers: int = IPU_WORKERS,
                   mapping: Optional[TileMapping] = None) -> torch.Tensor:
    """Run PartialAmax on every tile holding input (``mapping``, else the even split over
    ``tiles``): float32 ``[tiles, workers]``, 0 where a tile or worker has no data."""
    lib = _host.library()
    flat = _flat_input(x)
    layout = _mapping_for(flat.numel(), tiles, mapping)
    memory = _TileMemory(layout)
    buffer = memory.gather(flat)
    dtype = _host.dtype_code(flat.dtype)
    partials = torch.zeros((len(layout), workers), dtype=torch.float32)
    for t, spans in enumerate(memory.spans):
        if not spans:
            continue  # no vertex on a tile that holds no input
        out = _address(partials, t * workers)
        if len(spans) == 1:
            offset, length = spans[0]
            status = lib.ius_vertex_partial_amax(_address(buffer, offset), length, dtype,
                                                 workers, out)
        else:
            pointers, lengths, count = memory.addresses(buffer, t)
            status = _function("ius_vertex_partial_amax_regions")(pointers, lengths, count,
                                                                  dtype, workers, out)
        _check(status, "PartialAmax")
    return partials


def scaling_bias_vertex(partials: torch.Tensor, fmt: FP8Format, margin: int = 0
                        ) -> Tuple[int, bool]:
    """Run one ``ScalingBias`` vertex on the partials: (log2 scale, amax non-finite)."""
    lib = _host.library()
    flat = partials.detach().to(torch.float32).contiguous().reshape(-1)
    scale = ctypes.c_int(0)
    non_finite = ctypes.c_int(0)
    status = lib.ius_vertex_scaling_bias(_address(flat), flat.numel(),
                                         _host.exponent_bits(fmt.name), int(margin),
                                         ctypes.byref(scale), ctypes.byref(non_finite))
    _check(status, "ScalingBias")
    return scale.value, bool(non_finite.value)


def leaf_tiles(mapping: TileMapping) -> List[int]:
    """The tiles holding input: the amax tree's leaves, in tile order."""
    return [t for t, regions in enumerate(mapping) if regions]


class AmaxReduction(NamedTuple):
    amax: float  # what the root reduces its partials to (NaN-aware, as on the tiles)
    log2_scale: int
    non_finite: bool


def reduce_amax(partials: torch.Tensor, leaves: Sequence[int], fmt: FP8Format, margin: int = 0,
                rotation: int = 0) -> AmaxReduction:
    """Reduce the partials (``[tiles, workers]``) of the ``leaves`` tiles up the amax tree, as
    the graph does: MaxPartials at every inner node, ScalingBias at the root. The amax is the
    root's partials reduced by the MaxPartials code, the loop ScalingBias runs first."""
    tree = amax_tree(leaves, rotation)
    children = tree.children()
    max_partials = _function("ius_vertex_max_partials")

    def reduce(inputs: List[torch.Tensor]) -> torch.Tensor:
        values = torch.cat(inputs).contiguous() if inputs else torch.zeros(1)
        amax = torch.zeros(1, dtype=torch.float32)
        _check(max_partials(_address(values), values.numel(), _address(amax)), "MaxPartials")
        return amax

    results: List[torch.Tensor] = [partials[t].to(torch.float32).contiguous() for t in leaves]
    for node in range(tree.leaves, tree.root):  # inner nodes come level by level
        results.append(reduce([results[c] for c in children[node]]))
    root_inputs = [results[c] for c in children[tree.root]]
    root_partials = torch.cat(root_inputs) if root_inputs else torch.zeros(1)
    log2_scale, non_finite = scaling_bias_vertex(root_partials, fmt, margin)
    return AmaxReduction(reduce(root_inputs).item(), log2_scale, non_finite)


def cast_to_fp8_vertices(
    x: torch.Tensor,
    fmt: object,
    log2_scale: Optional[int] = None,
    margin: int = 0,
    overflow: str = "saturate",
    tiles: int = IPU_TILES,
    workers: int = IPU_WORKERS,
    mapping: Optional[TileMapping] = None,
    rotation: int = 0,
) -> TileCast:
    """Run ``CastToFp8`` on every tile holding x (after ``PartialAmax``, the ``MaxPartials``
    tree and ``ScalingBias`` when no scale is given): amax, scaling bias and cast to F143/F152,
    vertex by vertex and tile by tile.

    Same contract as :func:`ipu_unit_scaling.fp8.cast_to_fp8` with rounding to nearest:
    ``log2_scale=None`` derives the scale from the amax, reduced up the graph's amax tree (an
    inf/NaN amax raises ``NonFiniteAmaxError``, as the host reads the vertex's non-finite
    flag). ``mapping`` lays x out over the tiles (default: the even split over ``tiles``);
    ``rotation`` is the op id the graph gives the tree.
    """
    fmt = get_format(fmt)  # type: ignore[arg-type]
    if overflow not in _OVERFLOW_POLICIES:
        raise ValueError(f"overflow policy must be one of {_OVERFLOW_POLICIES}, got {overflow!r}")
    lib = _host.library()
    exponent_bits = _host.exponent_bits(fmt.name)
    flat = _flat_input(x)
    dtype = _host.dtype_code(flat.dtype)
    layout = _mapping_for(flat.numel(), tiles, mapping)

    partials: Optional[torch.Tensor] = None
    if log2_scale is not None and not -MAX_LOG2_SCALE <= log2_scale <= MAX_LOG2_SCALE:
        raise ValueError(f"log2_scale must be in -{MAX_LOG2_SCALE}..{MAX_LOG2_SCALE}")
    if log2_scale is None:
        partials = partial_amaxes(flat, workers=workers, mapping=layout)
        reduction = reduce_amax(partials, leaf_tiles(layout), fmt, margin, rotation)
        if reduction.non_finite:
            raise NonFiniteAmaxError(
                f"amax is {reduction.amax}; cannot choose an FP8 scale for {fmt.name}")
        log2_scale = reduction.log2_scale

    memory = _TileMemory(layout)
    buffer = memory.gather(flat)
    codes = torch.zeros(buffer.numel(), dtype=torch.uint8)
    saturate = int(overflow == "saturate")
    for t, spans in enumerate(memory.spans):
        if not spans:
            continue
        if len(spans) == 1:
            offset, length = spans[0]
            status = lib.ius_vertex_cast_to_fp8(
                _address(buffer, offset), length, dtype, exponent_bits, saturate, workers,
                int(log2_scale), _address(codes, offset))
        else:
            inputs, lengths, count = memory.addresses(buffer, t)
            outputs, _, _ = memory.addresses(codes, t)
            status = _function("ius_vertex_cast_to_fp8_regions")(
                inputs, outputs, lengths, count, dtype, exponent_bits, saturate, workers,
                int(log2_scale))
        _check(status, "CastToFp8")
    return TileCast(memory.scatter(codes, flat.numel()).reshape(x.shape), int(log2_scale),
                        partials)


def cast_from_fp8_vertices(
    codes: torch.Tensor,
    fmt: object,
    log2_scale: int,
    dtype: torch.dtype = torch.float32,
    tiles: int = IPU_TILES,
    workers: int = IPU_WORKERS,
    mapping: Optional[TileMapping] = None,
) -> torch.Tensor:
    """Run CastFromFp8 on every tile holding codes: ``decode(codes) * 2**-log2_scale`` as
    float32/float16, laid out like the codes (``mapping``, default the even split)."""
    fmt = get_format(fmt)  # type: ignore[arg-type]
    lib = _host.library()
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    flat = codes.detach().contiguous().reshape(-1)
    out_dtype = _host.dtype_code(dtype)
    exponent_bits = _host.exponent_bits(fmt.name)
    memory = _TileMemory(_mapping_for(flat.numel(), tiles, mapping))
    buffer = memory.gather(flat)
    out = torch.zeros(buffer.numel(), dtype=dtype)
    for t, spans in enumerate(memory.spans):
        if not spans:
            continue
        if len(spans) == 1:
            offset, length = spans[0]
            status = lib.ius_vertex_cast_from_fp8(_address(buffer, offset), length, out_dtype,
                                                  exponent_bits, workers, int(log2_scale),
                                                  _address(out, offset))
        else:
            inputs, lengths, count = memory.addresses(buffer, t)
            outputs, _, _ = memory.addresses(out, t)
            status = _function("ius_vertex_cast_from_fp8_regions")(
                inputs, outputs, lengths, count, out_dtype, exponent_bits, workers,
                int(log2_scale))
        _check(status, "CastFromFp8")
    return memory.scatter(out, flat.numel()).reshape(codes.shape)


def fp8_quantise_graph(
    x: torch.Tensor,
    fmt: object,
    log2_scale: Optional[int] = None,
    margin: int = 0,
    overflow: str = "saturate",
    tiles: int = IPU_TILES,
    workers: int = IPU_WORKERS,
    mapping: Optional[TileMapping] = None,
    rotation: int = 0,
) -> Tuple[torch.Tensor, int, bool]:
    """The ``Fp8Quantise`` graph, vertex by vertex: ``decode(cast(x * 2**s)) * 2**-s``.

    Returns (values in x's dtype and shape, s, the non-finite flag). As on the IPU, a
    non-finite amax does not raise: ScalingBias writes s = 0 and sets the flag, and the cast
    goes on with s = 0.
    """
    fmt = get_format(fmt)  # type: ignore[arg-type]
    flat = _flat_input(x)
    layout = _mapping_for(flat.numel(), tiles, mapping)
    flag = False
    if log2_scale is None:
        partials = partial_amaxes(flat, workers=workers, mapping=layout)
        reduction = reduce_amax(partials, leaf_tiles(layout), fmt, margin, rotation)
        log2_scale, flag = reduction.log2_scale, reduction.non_finite
    codes = cast_to_fp8_vertices(flat, fmt, log2_scale, margin, overflow, workers=workers,
                        mapping=layout).codes
    values = cast_from_fp8_vertices(codes, fmt, log2_scale, x.dtype, workers=workers,
                                    mapping=layout)
    return values.reshape(x.shape), log2_scale, flag


