"""A host model of the Poplar graph the FP8 codelets build: which vertex runs on which tile, the
edges each one reads and writes, and the copies a layout needs, so that a placement (the amax
tree, tile mappings) can be measured without an IPU: the busiest tile, exchanged elements.
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence, Tuple

import numpy as np
import torch

from .codelets_on_host import (
    IPU_WORKERS,
    Interval,
    Region,
    TileMapping,
    amax_tree,
    flat_mapping,
    leaf_tiles,
    region_length,
    tile_ranges,
)

__all__ = [
    "Edge", "ModelVertex", "GraphModel", "TileLoad", "graph_model", "flat_graph_model",
    "Transfer", "tile_loads", "busiest_tile", "exchanged_elements",
]






class Edge(NamedTuple):
    """A vertex field's connection to one piece of a tensor, held by one tile."""

    field: str
    tile: int  # the tile holding the piece
    elements: int
    bytes: int
    data: bool  # a piece of x, the codes or the values (not partials, not the scale)


class ModelVertex(NamedTuple):
    compute_set: str
    codelet: str  # without template arguments
    tile: int
    edges: Tuple[Edge, ...]


class Transfer(NamedTuple):
    """A piece of x that a program copy moves from one tile to another."""

    source: int
    destination: int
    elements: int
    bytes: int


class GraphModel(NamedTuple):
    tiles: int
    vertices: List[ModelVertex]
    copies: List[Transfer]


class TileLoad(NamedTuple):
    tile: int
    vertices: int
    edges: int  # the edges of the tile's vertices
    remote_edges: int  # those whose piece another tile holds: exchanged in
    bytes_in: int  # bytes exchanged into the tile (remote edges and copies)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _data_edges(field: str, tile: int, regions: Sequence[Region], size: int) -> Tuple[Edge, ...]:
    return tuple(Edge(field, tile, region_length(r), region_length(r) * size, True)
                 for r in regions)


def _cast_vertices(leaves: Sequence[int], mapping: TileMapping, input_size: int,
                   scale_tile: int, quantise: bool) -> List[ModelVertex]:
    """CastToFp8 (and CastFromFp8) on every tile holding input, on the tile's own regions."""
    scale = Edge("log2Scale", scale_tile, 1, 4, False)
    passes = [("CastToFp8", input_size, 1)] + ([("CastFromFp8", 1, input_size)] if quantise else [])
    vertices = []
    for name, in_size, out_size in passes:
        for t in leaves:
            regions = mapping[t]
            codelet = name if len(regions) == 1 else name + "Regions"
            edges = (_data_edges("in", t, regions, in_size) + (scale,)
                     + _data_edges("out", t, regions, out_size))
            vertices.append(ModelVertex(name, codelet, t, edges))
    return vertices


def graph_model(mapping: TileMapping, dtype: torch.dtype = torch.float16, quantise: bool = True,
                workers: int = IPU_WORKERS, rotation: int = 0) -> GraphModel:
    """The vertices and edges ``CodeletOpx`` adds for an input laid out by ``mapping``:
    ``Fp8Quantise`` (``quantise``) or ``Fp8AmaxCast``. ``rotation`` is the op's id."""
    size = _element_size(dtype)
    leaves = leaf_tiles(mapping)
    vertices = []
    for t in leaves:
        regions = mapping[t]
        codelet = "PartialAmax" if len(regions) == 1 else "PartialAmaxRegions"
        edges = (_data_edges("in", t, regions, size)
                 + (Edge("partials", t, workers, 4 * workers, False),))
        vertices.append(ModelVertex("PartialAmax", codelet, t, edges))
    tree = amax_tree(leaves, rotation)
    children = tree.children()
    for node in range(tree.leaves, len(tree.tiles)):
        tile = tree.tiles[node]
        inputs = tuple(Edge("partials", tree.tiles[c], workers if c < tree.leaves else 1,
                            4 * (workers if c < tree.leaves else 1), False)
                       for c in children[node])
        if node < tree.root:
            vertices.append(ModelVertex("MaxPartials", "MaxPartials", tile,
                                        inputs + (Edge("amax", tile, 1, 4, False),)))
        else:
            inputs = inputs or (Edge("partials", tile, 1, 4, False),)  # a zero: no input
            outputs = (Edge("log2Scale", tile, 1, 4, False), Edge("nonFinite", tile, 1, 4, False))
            vertices.append(ModelVertex("ScalingBias", "ScalingBias", tile, inputs + outputs))
    vertices += _cast_vertices(leaves, mapping, size, tree.tiles[tree.root], quantise)
    return GraphModel(len(mapping), vertices, [])


def _merged_intervals(regions: Sequence[Region]) -> List[Interval]:
    merged: List[Interval] = []
    for begin, end in sorted(i for region in regions for i in region):
        if merged and merged[-1][1] == begin:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((begin, end))
    return merged


def _layout_copies(mapping: TileMapping, size: int) -> List[Transfer]:
    """What copying x from ``mapping`` into the even split moves, piece by piece."""
    numel = sum(region_length(r) for regions in mapping for r in regions)
    intervals = sorted((b, e, t) for t, regions in enumerate(mapping)
                       for region in regions for b, e in region)
    starts = np.array([b for b, _, _ in intervals], dtype=np.int64)
    copies = []
    for destination, (begin, end) in enumerate(tile_ranges(numel, len(mapping))):
        i = max(int(np.searchsorted(starts, begin, side="right")) - 1, 0)
        while i < len(intervals) and intervals[i][0] < end:
            b, e, source = intervals[i]
            piece = min(e, end) - max(b, begin)
            if piece > 0:
                copies.append(Transfer(source, destination, piece, piece * size))
            i += 1
    return copies


def flat_graph_model(mapping: TileMapping, dtype: torch.dtype = torch.float16,
                     quantise: bool = True, workers: int = IPU_WORKERS) -> GraphModel:
    """The earlier graph for the same input: x copied into the even split over the tiles
    (unless it was laid out so), the vertices on that split, and one ScalingBias on tile 0
    reading the partials of every tile holding input; outputs left in the even split."""
    size = _element_size(dtype)
    numel = sum(region_length(r) for regions in mapping for r in regions)
    tiles = len(mapping)
    flat = flat_mapping(numel, tiles)
    laid_out = all(_merged_intervals(mapping[t]) == list(flat[t][0] if flat[t] else ())
                   for t in range(tiles))
    copies = [] if laid_out else _layout_copies(mapping, size)
    leaves = leaf_tiles(flat)
    vertices = [ModelVertex("PartialAmax", "PartialAmax", t,
                            _data_edges("in", t, flat[t], size)
                            + (Edge("partials", t, workers, 4 * workers, False),))
                for t in leaves]
    inputs = tuple(Edge("partials", t, workers, 4 * workers, False) for t in leaves)
    inputs = inputs or (Edge("partials", 0, 1, 4, False),)
    outputs = (Edge("log2Scale", 0, 1, 4, False), Edge("nonFinite", 0, 1, 4, False))
    vertices.append(ModelVertex("ScalingBias", "ScalingBias", 0, inputs + outputs))
    vertices += _cast_vertices(leaves, flat, size, 0, quantise)
    return GraphModel(tiles, vertices, copies)


def tile_loads(*models: GraphModel) -> List[TileLoad]:
    """Per tile, what the graphs (one, or several sharing the IPU) place there."""
    tiles = max(m.tiles for m in models)
    vertices = np.zeros(tiles, dtype=np.int64)
    edges = np.zeros(tiles, dtype=np.int64)
    remote = np.zeros(tiles, dtype=np.int64)
    bytes_in = np.zeros(tiles, dtype=np.int64)
    for model in models:
        for vertex in model.vertices:
            vertices[vertex.tile] += 1
            edges[vertex.tile] += len(vertex.edges)
            for edge in vertex.edges:
                if edge.tile != vertex.tile:
                    remote[vertex.tile] += 1
                    bytes_in[vertex.tile] += edge.bytes
        for copy in model.copies:
            if copy.source != copy.destination:
                bytes_in[copy.destination] += copy.bytes
    return [TileLoad(t, int(vertices[t]), int(edges[t]), int(remote[t]), int(bytes_in[t]))
            for t in range(tiles)]


def busiest_tile(*models: GraphModel) -> TileLoad:
    """The tile with the most edges (then the most vertices, then the lowest index)."""
    return max(tile_loads(*models), key=lambda load: (load.edges, load.vertices, -load.tile))


def exchanged_elements(*models: GraphModel) -> int:
    """Elements of x, the codes or the values that move between tiles."""
    moved = 0
    for model in models:
        moved += sum(c.elements for c in model.copies if c.source != c.destination)
        moved += sum(e.elements for v in model.vertices for e in v.edges
                     if e.data and e.tile != v.tile)
    return moved
