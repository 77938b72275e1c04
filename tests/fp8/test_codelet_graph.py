"""Where the FP8 graph puts its vertices: the amax tree, vertices on the input's own tiles.

The plan is C++ (codelets/placement.hpp, codelets/partition.hpp) shared by the custom op's
graph construction and, through the host library, by the codelets run on the host and their
graph model; these tests check the plan against its stated rule, run the vertices over it,
and count the graph.
"""
from __future__ import annotations

import ctypes
import math
import random
import re

import numpy as np
import pytest
import torch
from helpers import ROOT as REPO

from ipu_unit_scaling.fp8 import (
    F143,
    F152,
    NonFiniteAmaxError,
    cast_to_fp8_reference,
    codelet_graph,
)
from ipu_unit_scaling.fp8 import codelets_on_host as on_host
from ipu_unit_scaling.fp8 import host_library as _host

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("host_library")]

GRAIN = 8


def fan_in(leaves: int) -> int:
    """ceil(sqrt(leaves)), at least 2: the rule placement.hpp states."""
    root = math.isqrt(leaves)
    return max(2, root if root * root == leaves else root + 1)


# --- the amax tree -------------------------------------------------------------------------


def test_amax_tree_follows_its_rule_on_a_small_case():
    # 10 leaves: F = 4, so ceil(10 / 4) = 3 groups of 4, 3 and 3 neighbours, then the root.
    leaves = [3, 5, 8, 13, 21, 34, 55, 89, 144, 233]
    tree = on_host.amax_tree(leaves, rotation=0)
    assert tree.leaves == 10 and tree.root == 13
    assert tree.parents == [10] * 4 + [11] * 3 + [12] * 3 + [13, 13, 13, -1]
    assert tree.levels == [0] * 10 + [1, 1, 1, 2]
    # Rotation 0: each group's vertex on its first member's tile.
    assert tree.tiles == leaves + [3, 21, 89, 3]
    # Rotation 5: member 5 % 4 = 1, then 5 % 3 = 2 of each group; the root on member 2.
    rotated = on_host.amax_tree(leaves, rotation=5)
    assert rotated.parents == tree.parents
    assert rotated.tiles == leaves + [5, 55, 233, 233]


def test_amax_tree_without_input_and_with_one_tile():
    empty = on_host.amax_tree([])
    assert empty == on_host.AmaxTree([0], [-1], [1], 0)  # ScalingBias alone, on tile 0
    single = on_host.amax_tree([17], rotation=3)
    assert single == on_host.AmaxTree([17, 17], [1, -1], [0, 1], 1)


@pytest.mark.parametrize("leaves", [1, 2, 3, 4, 5, 16, 17, 39, 40, 368, 1471, 1472])
@pytest.mark.parametrize("rotation", [0, 1, 37, 1000])
def test_amax_tree_reads_at_most_the_fan_in_everywhere(leaves, rotation):
    leaf_tiles = random.Random(leaves).sample(range(2 * leaves), leaves)
    tree = on_host.amax_tree(leaf_tiles, rotation)
    children = tree.children()
    bound = fan_in(leaves)
    assert tree.tiles[:leaves] == leaf_tiles
    assert all(p >= 0 for p in tree.parents[:-1]) and tree.parents[-1] == -1
    assert max(len(c) for c in children) <= bound
    assert tree.levels[tree.root] <= 2  # at most one level of MaxPartials
    for node in range(leaves, len(tree.tiles)):
        assert children[node], node  # no idle vertex
        assert all(tree.levels[c] == tree.levels[node] - 1 for c in children[node])
        # The vertex sits on one of its inputs' tiles: that input is not exchanged.
        assert tree.tiles[node] in {tree.tiles[c] for c in children[node]}
    # Every leaf reaches the root exactly once.
    reached = [0] * len(tree.tiles)
    for leaf in range(leaves):
        node = leaf
        while node != tree.root:
            node = tree.parents[node]
        reached[leaf] += 1
    assert reached[:leaves] == [1] * leaves


def test_rotation_spreads_the_roots_of_many_graphs():
    # 20 FP8 linears x 3 quantised tensors on one IPU, op ids 0..59: graph r's root is member
    # r % 38 of the 38 group vertices, each on its group's member r % (38 or 39), so the 60
    # roots land on 60 different tiles (all on tile 0 before rotation).
    leaves = list(range(1472))
    roots = [on_host.amax_tree(leaves, rotation=r).tiles[-1] for r in range(60)]
    assert len(set(roots)) == 60


# --- worker pieces of a tile holding several regions ---------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_region_pieces_cover_each_region_in_balanced_grain_aligned_pieces(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 9))]
    workers = rng.randint(1, 6)
    pieces = on_host.region_pieces(lengths, workers)
    for r, length in enumerate(lengths):
        taken = [(int(b), int(e)) for b, e in pieces[:, r].tolist() if e > b]
        assert [b for b, _ in taken] == sorted(b for b, _ in taken)
        assert taken[0][0] == 0 and taken[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(taken, taken[1:]))  # no gap, no overlap
        assert all(b % GRAIN == 0 for b, _ in taken)  # no two workers share a word
    grains = [sum(-(-(int(e) - int(b)) // GRAIN) for b, e in pieces[w].tolist())
              for w in range(workers)]
    assert max(grains) - min(grains) <= 1
    assert sum(grains) == sum(-(-length // GRAIN) for length in lengths)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 100, 8 * 6 + 5])
@pytest.mark.parametrize("workers", [1, 4, 6])
def test_one_region_is_split_as_the_one_dimensional_vertices_split(length, workers):
    pieces = on_host.region_pieces([length], workers)[:, 0]
    expected = _host.partition(length, 1, workers)[0]
    taken = expected[:, 1] > expected[:, 0]
    assert torch.equal(pieces[taken], expected[taken])
    assert bool((pieces[~taken, 1] == pieces[~taken, 0]).all())  # and nothing elsewhere


def test_regions_vertex_partials_are_the_amaxes_of_each_workers_pieces():
    rng = random.Random(3)
    lengths = [rng.randint(1, 90) for _ in range(7)]
    numel = sum(lengths)
    x = torch.randn(numel) * torch.rand(numel) * 100
    starts = np.cumsum([0] + lengths)
    region_tuple = [((int(b), int(e)),) for b, e in zip(starts[:-1], starts[1:])]
    partials = on_host.partial_amaxes(x, workers=5, mapping=[region_tuple])
    pieces = on_host.region_pieces(lengths, 5)
    for w in range(5):
        values = [x[starts[r] + b:starts[r] + e] for r, (b, e) in enumerate(pieces[w].tolist())]
        joined = torch.cat(values)
        expected = joined.abs().max().item() if joined.numel() else 0.0
        assert partials[0, w].item() == expected


def test_regions_vertex_refuses_a_misaligned_output_region():
    cast = on_host._function("ius_vertex_cast_to_fp8_regions")
    x = torch.randn(64)
    codes = torch.zeros(80, dtype=torch.uint8)
    assert codes.data_ptr() % 8 == 0
    inputs = (ctypes.c_void_p * 2)(x.data_ptr(), x.data_ptr() + 32 * 4)
    lengths = (ctypes.c_int64 * 2)(32, 32)
    for offset, expected in ((32, 0), (33, _host.MISALIGNED)):
        outputs = (ctypes.c_void_p * 2)(codes.data_ptr(), codes.data_ptr() + offset)
        assert cast(inputs, outputs, lengths, 2, 0, 4, 1, 6, 0) == expected


# --- running the graph on other layouts ----------------------------------------------------


def irregular_mapping(numel: int, tiles: int, seed: int) -> on_host.TileMapping:
    """Random intervals on random tiles, grouped into regions of one to three intervals."""
    rng = random.Random(seed)
    intervals, begin = [], 0
    while begin < numel:
        end = min(numel, begin + rng.randint(1, 300))
        intervals.append((begin, end))
        begin = end
    rng.shuffle(intervals)
    mapping: on_host.TileMapping = [[] for _ in range(tiles)]
    while intervals:
        take = rng.randint(1, 3)
        region, intervals = tuple(intervals[:take]), intervals[take:]
        mapping[rng.randrange(tiles - 1)].append(region)  # the last tile stays empty
    return mapping


def wide_range(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    spread = torch.exp((torch.randn(shape, generator=generator) * 3.0).clamp(-14.0, 7.0))
    return (torch.randn(shape, generator=generator) * spread).to(dtype)


LAYOUTS = {
    "blocks": lambda: on_host.block_mapping(64, 256, 4, 4, tiles=20),
    "row-segments": lambda: on_host.block_mapping(64, 256, 4, 4, tiles=20,
                                                   contiguous_blocks=False),
    "irregular": lambda: irregular_mapping(64 * 256, 9, seed=5),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("fmt", [F143, F152], ids=str)
def test_graph_on_any_layout_equals_the_reference(layout, dtype, fmt):
    mapping = LAYOUTS[layout]()
    x = wide_range((64, 256), dtype, seed=len(layout))
    expected = cast_to_fp8_reference(x, fmt, margin=1, overflow="nan")
    for rotation in (0, 7):
        result = on_host.cast_to_fp8_vertices(x, fmt, margin=1, overflow="nan", mapping=mapping,
                                      rotation=rotation)
        assert result.log2_scale == expected.log2_scale
        assert torch.equal(result.codes, expected.codes)
    values, scale, flag = on_host.fp8_quantise_graph(x, fmt, mapping=mapping)
    reference = torch.ops.ipu_unit_scaling.fp8_quantise(x, fmt.name, 0, True, None)
    assert not flag and values.dtype == dtype
    assert torch.equal(values.isnan(), reference.isnan())
    assert torch.equal(values[~reference.isnan()], reference[~reference.isnan()])


def test_the_tree_reduces_a_full_ipu_layout_to_the_exact_amax():
    # A 1024 x 4096 activation laid out in 16 x 92 blocks, one per tile of the IPU.
    mapping = on_host.block_mapping(1024, 4096, 16, 92)
    x = wide_range((1024, 4096), torch.float32, seed=11)
    partials = on_host.partial_amaxes(x, mapping=mapping)
    leaves = on_host.leaf_tiles(mapping)
    assert len(leaves) == 1472
    reduction = on_host.reduce_amax(partials, leaves, F143, rotation=2)
    assert reduction.amax == x.double().abs().max().item()
    assert reduction.log2_scale == cast_to_fp8_reference(x, F143).log2_scale
    result = on_host.cast_to_fp8_vertices(x, F143, mapping=mapping)
    assert torch.equal(result.codes, cast_to_fp8_reference(x, F143).codes)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_element_reaches_the_root(bad):
    mapping = LAYOUTS["irregular"]()
    x = torch.randn(64 * 256)
    x[9876] = bad
    reduction = on_host.reduce_amax(on_host.partial_amaxes(x, mapping=mapping),
                                     on_host.leaf_tiles(mapping), F152)
    assert reduction.non_finite and reduction.log2_scale == 0
    assert math.isnan(reduction.amax) if math.isnan(bad) else reduction.amax == math.inf
    with pytest.raises(NonFiniteAmaxError):
        on_host.cast_to_fp8_vertices(x, F152, mapping=mapping)
    assert on_host.fp8_quantise_graph(x, F152, mapping=mapping)[1:] == (0, True)


def test_empty_input_gives_a_zero_amax():
    values, scale, flag = on_host.fp8_quantise_graph(torch.zeros(0), F143, tiles=4)
    assert values.numel() == 0 and (scale, flag) == (0, False)


def test_a_mapping_must_hold_every_element_once():
    with pytest.raises(ValueError, match="unmapped"):
        on_host.check_mapping([[((0, 5),)], [((6, 10),)]], 10)
    with pytest.raises(ValueError, match="more than once"):
        on_host.check_mapping([[((0, 6),)], [((5, 10),)]], 10)
    with pytest.raises(ValueError, match="not a non-empty part"):
        on_host.cast_to_fp8_vertices(torch.ones(10), F143, mapping=[[((0, 11),)]])


# --- the graph, counted: 1472 tiles, a 1024 x 4096 tensor ----------------------------------


@pytest.fixture(scope="module")
def ipu_layouts():
    return {"matmul": on_host.block_mapping(1024, 4096, 16, 92),
            "flat": on_host.flat_mapping(1024 * 4096)}


def element_tiles(mapping: on_host.TileMapping, numel: int) -> np.ndarray:
    tiles = np.full(numel, -1, dtype=np.int64)
    for t, regions in enumerate(mapping):
        for region in regions:
            for begin, end in region:
                tiles[begin:end] = t
    return tiles


@pytest.mark.parametrize("layout", ["matmul", "flat"])
@pytest.mark.parametrize("quantise", [True, False], ids=["Fp8Quantise", "Fp8AmaxCast"])
def test_vertices_follow_the_mapping_and_the_tree_bounds_every_tile(ipu_layouts, layout,
                                                                   quantise):
    model = codelet_graph.graph_model(ipu_layouts[layout], quantise=quantise)
    assert codelet_graph.exchanged_elements(model) == 0 and model.copies == []
    for vertex in model.vertices:
        assert all(e.tile == vertex.tile for e in vertex.edges if e.data)
    bound = fan_in(1472)
    loads = codelet_graph.tile_loads(model)
    # Group inputs (<= F - 1 remote), root inputs (<= F - 1 remote), the scale per cast.
    assert max(load.remote_edges for load in loads) <= 2 * (bound - 1) + 1 + quantise
    assert max(load.vertices for load in loads) <= 4 + quantise
    # Outside the tree's tiles, a tile reads only the scale.
    tree_tiles = {v.tile for v in model.vertices if v.codelet in ("MaxPartials", "ScalingBias")}
    assert len(tree_tiles) == math.ceil(1472 / bound)
    assert all(load.remote_edges <= 1 + quantise for load in loads if load.tile not in tree_tiles)


@pytest.mark.parametrize("tiles", [368, 1472])
def test_the_earlier_graph_gathers_every_tile_on_tile_zero(tiles):
    mapping = on_host.flat_mapping(1024 * 4096, tiles)
    before = codelet_graph.tile_loads(codelet_graph.flat_graph_model(mapping))[0]
    after = codelet_graph.busiest_tile(codelet_graph.graph_model(mapping))
    assert before.remote_edges == tiles - 1  # one exchanged piece per other tile
    assert before.bytes_in == (tiles - 1) * 6 * 4
    assert after.remote_edges <= 2 * (fan_in(tiles) - 1)


def test_the_earlier_graph_moves_every_element_off_its_matmul_tile(ipu_layouts):
    numel = 1024 * 4096
    model = codelet_graph.flat_graph_model(ipu_layouts["matmul"])
    off_tile = element_tiles(ipu_layouts["matmul"], numel) != element_tiles(
        ipu_layouts["flat"], numel)
    assert codelet_graph.exchanged_elements(model) == int(off_tile.sum()) > 0.9 * numel
    flat_model = codelet_graph.flat_graph_model(ipu_layouts["flat"])
    assert flat_model.copies == [] and codelet_graph.exchanged_elements(flat_model) == 0


def test_row_segment_layouts_use_the_regions_vertices():
    mapping = on_host.block_mapping(1024, 4096, 16, 92, contiguous_blocks=False)
    model = codelet_graph.graph_model(mapping)
    tile_vertices = [v for v in model.vertices if v.codelet.endswith("Regions")]
    assert len(tile_vertices) == 3 * 1472  # PartialAmax, CastToFp8, CastFromFp8
    assert all(len([e for e in v.edges if e.field == "in"]) == 64 for v in tile_vertices)
    assert codelet_graph.exchanged_elements(model) == 0


# --- the C++ graph construction uses this plan ---------------------------------------------


def test_the_custom_op_builds_from_the_shared_plan():
    graph = (REPO / "custom_ops" / "fp8_graph.cpp").read_text()
    codelets = (REPO / "codelets" / "fp8_codelets.cpp").read_text()
    code = re.sub(r"//[^\n]*", "", graph)  # what compiles, not what the comments say
    assert "ius::planAmaxTree(" in code and "getSortedContiguousRegions(" in code
    assert "splitRange" not in code and "addCopy" not in code and "Copy(" not in code
    assert "CanCreate" not in code and "CanUnwind" in code
    model_codelets = {v.codelet for v in codelet_graph.graph_model(
        on_host.block_mapping(64, 64, 2, 2, tiles=4, contiguous_blocks=False)).vertices}
    model_codelets |= {v.codelet for v in codelet_graph.graph_model(
        on_host.flat_mapping(1000, 4)).vertices}
    assert model_codelets == {"PartialAmax", "PartialAmaxRegions", "MaxPartials", "ScalingBias",
                              "CastToFp8", "CastToFp8Regions", "CastFromFp8",
                              "CastFromFp8Regions"}
    for codelet in model_codelets:
        assert f'"{codelet}"' in code, codelet
        assert re.search(rf"class {codelet} : public (Multi)?Vertex", codelets), codelet
