"""Count what the FP8 custom op's graph puts on the busiest tile, before and after.

    python scripts/codelet_placement.py [--rows 1024] [--cols 4096] [--graphs 60]

Builds the host model of the graph (``ipu_unit_scaling.fp8.codelet_graph.graph_model``, driven
by the
C++ placement plan of ``codelets/placement.hpp``) and of the earlier graph
(``flat_graph_model``) for a float16 ``rows x cols`` input of ``Fp8Quantise`` on a 1472-tile
IPU, laid out as a matmul lays out its operand (16 x 92 blocks, one per tile) or in the
even split of the flat tensor, and prints Markdown tables: one graph, then ``--graphs`` such
graphs (op ids 0, 1, ...) on the same IPU. Then runs the graph's vertices on the host over the
matmul layout and checks the tree's amax against float64.
"""
from __future__ import annotations

import argparse
from typing import List

import torch

from ipu_unit_scaling.fp8 import F143, cast_to_fp8_reference, codelet_graph
from ipu_unit_scaling.fp8 import codelets_on_host as on_host

HEADER = ("| layout of x | graph | busiest tile | vertices | edges | remote edges | bytes in "
          "| x elements exchanged | most elements cast on a tile |\n"
          "|---|---|---|---|---|---|---|---|---|")


def row(layout: str, graph: str, *models: codelet_graph.GraphModel) -> str:
    busiest = codelet_graph.busiest_tile(*models)
    return (f"| {layout} | {graph} | {busiest.tile} | {busiest.vertices} | {busiest.edges} | "
            f"{busiest.remote_edges} | {busiest.bytes_in:,} | "
            f"{codelet_graph.exchanged_elements(*models):,} | {most_cast(models[0]):,} |")


def most_cast(model: codelet_graph.GraphModel) -> int:
    """The largest input of a CastToFp8 vertex: the tile whose cast takes longest."""
    return max(sum(e.elements for e in v.edges if e.field == "in")
               for v in model.vertices if v.compute_set == "CastToFp8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--graphs", type=int, default=60)
    args = parser.parse_args()
    numel = args.rows * args.cols
    layouts = {
        "matmul (16 x 92 blocks)": on_host.block_mapping(args.rows, args.cols, 16, 92),
        "flat (even split)": on_host.flat_mapping(numel),
    }
    single: List[str] = [HEADER]
    shared: List[str] = [HEADER]
    for name, mapping in layouts.items():
        before = codelet_graph.flat_graph_model(mapping)
        after = [codelet_graph.graph_model(mapping, rotation=r) for r in range(args.graphs)]
        single += [row(name, "before", before), row(name, "after", after[0])]
        shared += [row(name, "before", *[before] * args.graphs), row(name, "after", *after)]
    print(f"One Fp8Quantise graph, float16 {args.rows} x {args.cols}, 1472 tiles:\n")
    print("\n".join(single))
    print(f"\n{args.graphs} such graphs on one IPU (op ids 0 to {args.graphs - 1}):\n")
    print("\n".join(shared))

    mapping = layouts["matmul (16 x 92 blocks)"]
    x = (torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
         * 30).to(torch.float16)
    partials = on_host.partial_amaxes(x, mapping=mapping)
    reduction = on_host.reduce_amax(partials, on_host.leaf_tiles(mapping), F143)
    exact = x.double().abs().max().item()
    codes = on_host.cast_to_fp8_vertices(x, F143, mapping=mapping).codes
    same_codes = torch.equal(codes, cast_to_fp8_reference(x, F143).codes)
    print(f"\nAmax over the matmul layout, reduced up the tree: {reduction.amax!r}; float64 "
          f"amax: {exact!r}; equal: {reduction.amax == exact}; codes equal the reference: "
          f"{same_codes}")
    return 0 if reduction.amax == exact and same_codes else 1


if __name__ == "__main__":
    raise SystemExit(main())
