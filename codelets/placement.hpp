// Where the FP8 graph reduces its amax: the plan that the custom op's graph
// construction (custom_ops/fp8_graph.cpp) builds vertices from and that the
// host model of that graph (ipu_unit_scaling/emulator.py, through the host
// library) counts, so the model is the graph the op builds.
//
// Each tile holding input runs PartialAmax on its own data and keeps its
// partials. Gathering every tile's partials on one tile would give that tile
// one exchanged region and its bytes per tile of the IPU, so the partials are
// reduced in a tree instead, as poplibs' reductions do in stages: groups of at
// most F = ceil(sqrt(leaves)) neighbouring tiles send theirs to one member,
// whose MaxPartials vertex keeps their amax, and the root's ScalingBias
// reduces the (at most F) group results. No vertex reads more than F inputs,
// and there are at most two levels above the leaves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "partition.hpp"

namespace ius {

struct AmaxTree {
  // Per node: the tile its vertex runs on, and the node that reads its result
  // (-1 for the root). Nodes [0, leaves) are the PartialAmax leaves in the
  // order given; the others are listed level by level, the root last.
  std::vector<unsigned> tiles;
  std::vector<std::int64_t> parents;
  std::vector<unsigned> levels;  // 0 for leaves
  std::size_t leaves = 0;

  std::size_t root() const { return tiles.size() - 1; }
};

// The smallest F >= 2 with F * F >= leaves.
inline unsigned amaxTreeFanIn(std::size_t leaves) {
  unsigned fanIn = 2;
  while (static_cast<std::size_t>(fanIn) * fanIn < leaves) ++fanIn;
  return fanIn;
}

// Groups are runs of neighbouring nodes, split as evenly as splitRange splits
// elements. A group's vertex goes on the tile of its member `rotation` modulo
// the group's size: graphs given different rotations (the op's id) put their
// reduction vertices on different tiles. With no leaves the root is on tile 0.
inline AmaxTree planAmaxTree(const std::vector<unsigned>& leafTiles, std::uint64_t rotation) {
  AmaxTree tree;
  tree.leaves = leafTiles.size();
  tree.tiles = leafTiles;
  tree.parents.assign(leafTiles.size(), -1);
  tree.levels.assign(leafTiles.size(), 0);
  const std::size_t fanIn = amaxTreeFanIn(leafTiles.size());
  std::vector<std::size_t> level(leafTiles.size());
  for (std::size_t i = 0; i < level.size(); ++i) level[i] = i;
  for (unsigned depth = 1;; ++depth) {
    const std::size_t groups = level.size() <= fanIn ? 1 : (level.size() + fanIn - 1) / fanIn;
    std::vector<std::size_t> next;
    for (std::size_t g = 0; g < groups; ++g) {
      const auto members = splitRange<std::size_t>(level.size(), static_cast<unsigned>(groups),
                                                   static_cast<unsigned>(g), 1);
      const std::size_t size = members.end - members.begin;
      const std::size_t node = tree.tiles.size();
      const unsigned tile = size == 0 ? 0u : tree.tiles[level[members.begin + rotation % size]];
      tree.tiles.push_back(tile);
      tree.parents.push_back(-1);
      tree.levels.push_back(depth);
      for (std::size_t i = members.begin; i < members.end; ++i) {
        tree.parents[level[i]] = static_cast<std::int64_t>(node);
      }
      next.push_back(node);
    }
    if (groups == 1) break;
    level = next;
  }
  return tree;
}

// The grouped recipes' plan (custom_ops/fp8_group_quantise.cpp builds its
// graph from it; the emulator, ipu_unit_scaling/fp8/codelet_blocks.py, is
// checked against it through the host library). The groups of a rows x cols
// tensor: each row (kGroupRow), each 1 x size tile of a row (kGroupTile) or
// each size x size block (kGroupBlock), ragged at the ends, in row-major order
// of the grouped view (blocks: block row, then block column). A group is its
// row pieces (segments), listed group after group. The graph deals the groups
// to the tiles as splitRange deals elements, with a grain of one group.
constexpr int kGroupRow = 0;
constexpr int kGroupTile = 1;
constexpr int kGroupBlock = 2;

struct GroupPlan {
  std::vector<std::int64_t> starts;     // per segment: flat index of its first element
  std::vector<std::int64_t> lengths;    // per segment
  std::vector<std::int64_t> groupEnds;  // per group: one past its last segment
};

inline GroupPlan planGroups(std::int64_t rows, std::int64_t cols, int kind, std::int64_t size) {
  GroupPlan plan;
  if (kind == kGroupRow) size = cols;
  if (rows <= 0 || cols <= 0 || size <= 0) return plan;
  const std::int64_t perRow = (cols + size - 1) / size;
  const std::int64_t groupRows = kind == kGroupBlock ? size : 1;
  const std::int64_t bands = (rows + groupRows - 1) / groupRows;
  for (std::int64_t band = 0; band < bands; ++band) {
    for (std::int64_t column = 0; column < perRow; ++column) {
      const std::int64_t col = column * size;
      const std::int64_t length = cols - col < size ? cols - col : size;
      for (std::int64_t row = band * groupRows; row < (band + 1) * groupRows && row < rows;
           ++row) {
        plan.starts.push_back(row * cols + col);
        plan.lengths.push_back(length);
      }
      plan.groupEnds.push_back(static_cast<std::int64_t>(plan.starts.size()));
    }
  }
  return plan;
}

}  // namespace ius
