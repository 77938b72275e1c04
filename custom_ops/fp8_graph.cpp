// The Poplar graph around the FP8 codelets, shared by every FP8 custom op.
//
// Every vertex runs where its data already is, as poplibs' element-wise ops
// place theirs: the input is not moved to be measured or cast, and the outputs
// are laid out like the input (graph.clone), so the op that consumes them (a
// matmul, say) finds them where it laid its operand out.
//
//   every tile holding input:  PartialAmax<T>        its data -> one partial per worker
//   a tree over those tiles:   MaxPartials           a group's partials -> their amax
//   the tree's root:           ScalingBias<E>        <= F partials -> log2 scale, non-finite flag
//   every tile holding input:  CastToFp8<T, E, Sat>  its data -> uint8 codes
//   every tile holding codes:  CastFromFp8<T, E>     codes    -> decode(codes) * 2^-s
//
// The tree is ius::planAmaxTree (codelets/placement.hpp): no vertex reads more
// than F = ceil(sqrt(tiles holding input)) partials, instead of one vertex on
// tile 0 reading every tile's. A tile whose data is in several regions of its
// memory runs the ...Regions variant of a vertex. The host model of this graph
// (ipu_unit_scaling/emulator.py) uses the same plan through the host library.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <poplar/Graph.hpp>
#include <poplar/Interval.hpp>
#include <poplar/Program.hpp>
#include <poputil/VertexTemplates.hpp>
#include <popart/error.hpp>
#include <popart/region.hpp>
#include <popart/tensorinfo.hpp>

#include "fp8_ops.hpp"
#include "placement.hpp"

#ifndef IUS_CODELETS_GP
#define IUS_CODELETS_GP ""
#endif
#ifndef IUS_CODELETS_DIR
#define IUS_CODELETS_DIR ""
#endif

namespace ius_custom_ops {

namespace {

constexpr int64_t kMaxLog2Scale = 31;
constexpr int64_t kMaxMargin = 31;

// A tile's part of `t` as regions contiguous in the tile's memory, each a
// list of intervals of t (what getSortedContiguousRegions returns); empty for
// tiles holding none of t.
using TileRegions = std::vector<std::vector<poplar::Interval>>;

std::vector<TileRegions> regionsByTile(poplar::Graph& graph, const poplar::Tensor& t) {
  const auto mapping = graph.getTileMapping(t);
  std::vector<TileRegions> regions(mapping.size());
  for (std::size_t tile = 0; tile < mapping.size(); ++tile) {
    if (!mapping[tile].empty()) {
      regions[tile] = graph.getSortedContiguousRegions(t, mapping[tile]);
    }
  }
  return regions;
}

// An element-wise vertex on `tile`, each of `fields` connected to its tensor's
// part on that tile: `codelet` when the part is one region, else
// `regionsCodelet`, whose fields take the list of regions.
poplar::VertexRef addTileVertex(poplar::Graph& graph, poplar::ComputeSet& computeSet,
                                const std::string& codelet, const std::string& regionsCodelet,
                                unsigned tile, const TileRegions& regions,
                                const std::vector<std::pair<std::string, poplar::Tensor>>& fields) {
  const bool oneRegion = regions.size() == 1;
  poplar::VertexRef vertex = graph.addVertex(computeSet, oneRegion ? codelet : regionsCodelet);
  for (const auto& field : fields) {
    const std::vector<poplar::Tensor> parts = field.second.slices(regions);
    if (oneRegion) {
      graph.connect(vertex[field.first], parts.front());
    } else {
      graph.connect(vertex[field.first], parts);
    }
  }
  graph.setTileMapping(vertex, tile);
  return vertex;
}

poplar::Type poplarType(const popart::TensorInfo& info) {
  return info.dataType() == popart::DataType::FLOAT16 ? poplar::HALF : poplar::FLOAT;
}

}  // namespace

// The popc-compiled codelets when the build made them (one .gp holding the
// per-tensor and the grouped vertices), else the C++ sources, which Poplar then
// compiles itself. IPU_UNIT_SCALING_CODELETS (a .gp) overrides both.
void addFp8Codelets(poplar::Graph& graph) {
  if (graph.hasCodelet("PartialAmax<float>")) return;
  const char* override = std::getenv("IPU_UNIT_SCALING_CODELETS");
  const std::string precompiled = IUS_CODELETS_GP;
  const std::string directory = IUS_CODELETS_DIR;
  if (override != nullptr && *override != '\0') {
    graph.addCodelets(override, poplar::CodeletFileType::Auto, "-O3 -I" + directory);
  } else if (!precompiled.empty()) {
    graph.addCodelets(precompiled);
  } else {
    for (const char* source : {"/fp8_codelets.cpp", "/fp8_block_codelets.cpp"}) {
      graph.addCodelets(directory + source, poplar::CodeletFileType::Auto,
                        "-O3 -I" + directory);
    }
  }
}

Fp8Attributes Fp8Attributes::read(const popart::Attributes& attributes,
                                  const std::string& defaultFormat, int64_t defaultMargin) {
  Fp8Attributes result;
  result.format = attributes.getAttribute<popart::Attributes::String>("format", defaultFormat);
  result.margin = attributes.getAttribute<popart::Attributes::Int>("margin", defaultMargin);
  result.saturate = attributes.getAttribute<popart::Attributes::Int>("saturate", 1) != 0;
  result.hasLog2Scale =
      attributes.getAttribute<popart::Attributes::Int>("has_log2_scale", 0) != 0;
  result.log2Scale = attributes.getAttribute<popart::Attributes::Int>("log2_scale", 0);
  return result;
}

void Fp8Attributes::validate(const std::string& opName) const {
  if (format != "F143" && format != "F152") {
    throw popart::error("{}: format must be F143 or F152, got {}", opName, format);
  }
  if (margin < 0 || margin > kMaxMargin) {
    throw popart::error("{}: margin must be in 0..{}, got {}", opName, kMaxMargin, margin);
  }
  if (hasLog2Scale && (log2Scale < -kMaxLog2Scale || log2Scale > kMaxLog2Scale)) {
    throw popart::error("{}: log2_scale must be in -{}..{}, got {}", opName, kMaxLog2Scale,
                        kMaxLog2Scale, log2Scale);
  }
}

void Fp8Attributes::appendTo(popart::OpSerialiserBase& os) const {
  os.appendAttribute("format", format);
  os.appendAttribute("margin", margin);
  os.appendAttribute("saturate", static_cast<int64_t>(saturate));
  os.appendAttribute("has_log2_scale", static_cast<int64_t>(hasLog2Scale));
  os.appendAttribute("log2_scale", log2Scale);
}

// Input 0 takes its layout from whatever consumes output 0, as for
// poplibs' element-wise ops: a matmul reading the codes or the quantised
// values lays them out, and that layout reaches x without a copy.
popart::popx::InputCreatorType CodeletOpx::getInputCreatorType(popart::InIndex index) const {
  return index == 0 ? popart::popx::InputCreatorType::CanUnwind
                    : popart::popx::Opx::getInputCreatorType(index);
}

bool CodeletOpx::canUnwind(popart::InIndex in, popart::OutIndex out) const {
  return in == 0 && out == 0;
}

poplar::Tensor CodeletOpx::unwindTensorLayout(poplar::Tensor tensor, popart::InIndex in,
                                              popart::OutIndex) const {
  const poplar::Type type = poplarType(inInfo(in));
  return tensor.elementType() == type ? tensor
                                      : graph().clone(type, tensor, debugContext("unwound"));
}

popart::view::RegMap CodeletOpx::unwindRegion(popart::InIndex, popart::OutIndex) const {
  return [](const popart::view::Region& region) { return popart::view::Regions(1, region); };
}

CodeletOpx::Scale CodeletOpx::growScale(poplar::program::Sequence& prog,
                                        const poplar::Tensor& flat,
                                        const Fp8Attributes& attributes) const {
  poplar::Graph& g = graph();
  addFp8Codelets(g);
  Scale scale;
  if (attributes.hasLog2Scale) {
    scale.log2Scale = g.addConstant(poplar::INT, {}, static_cast<int>(attributes.log2Scale),
                                    debugContext("log2Scale"));
    scale.nonFinite = g.addConstant(poplar::INT, {}, 0, debugContext("nonFinite"));
    g.setTileMapping(scale.log2Scale, 0);
    g.setTileMapping(scale.nonFinite, 0);
    return scale;
  }
  scale.log2Scale = g.addVariable(poplar::INT, {}, debugContext("log2Scale"));
  scale.nonFinite = g.addVariable(poplar::INT, {}, debugContext("nonFinite"));

  const unsigned workers = g.getTarget().getNumWorkerContexts();
  const std::vector<TileRegions> regions = regionsByTile(g, flat);
  poplar::ComputeSet amax = g.addComputeSet(debugContext("PartialAmax"));
  const poplar::Type elementType = flat.elementType();
  std::vector<unsigned> leafTiles;
  std::vector<poplar::Tensor> leafPartials;
  for (unsigned t = 0; t < regions.size(); ++t) {
    if (regions[t].empty()) continue;
    poplar::Tensor partials = g.addVariable(poplar::FLOAT, {workers}, debugContext("partials"));
    g.setTileMapping(partials, t);
    auto vertex = addTileVertex(g, amax, poputil::templateVertex("PartialAmax", elementType),
                                poputil::templateVertex("PartialAmaxRegions", elementType), t,
                                regions[t], {{"in", flat}});
    g.connect(vertex["partials"], partials);
    leafTiles.push_back(t);
    leafPartials.push_back(partials);
  }
  prog.add(poplar::program::Execute(amax, debugContext("amax")));

  const ius::AmaxTree tree = ius::planAmaxTree(leafTiles, static_cast<std::uint64_t>(op_p->id));
  // Per node, the partials of its children, added as each child is built.
  std::vector<std::vector<poplar::Tensor>> children(tree.tiles.size());
  for (std::size_t leaf = 0; leaf < tree.leaves; ++leaf) {
    children[static_cast<std::size_t>(tree.parents[leaf])].push_back(leafPartials[leaf]);
  }
  const std::size_t root = tree.root();
  for (unsigned level = 1; level < tree.levels[root]; ++level) {
    poplar::ComputeSet reduce = g.addComputeSet(debugContext("MaxPartials"));
    for (std::size_t node = tree.leaves; node < root; ++node) {
      if (tree.levels[node] != level) continue;
      poplar::Tensor groupAmax = g.addVariable(poplar::FLOAT, {1}, debugContext("groupAmax"));
      g.setTileMapping(groupAmax, tree.tiles[node]);
      auto vertex = g.addVertex(reduce, "MaxPartials",
                                {{"partials", poplar::concat(children[node])},
                                 {"amax", groupAmax[0]}});
      g.setTileMapping(vertex, tree.tiles[node]);
      children[static_cast<std::size_t>(tree.parents[node])].push_back(groupAmax);
    }
    prog.add(poplar::program::Execute(reduce, debugContext("amaxTree")));
  }

  const unsigned rootTile = tree.tiles[root];
  g.setTileMapping(scale.log2Scale, rootTile);
  g.setTileMapping(scale.nonFinite, rootTile);
  poplar::Tensor rootPartials;
  if (children[root].empty()) {  // no input: the amax is 0
    rootPartials = g.addConstant(poplar::FLOAT, {1}, 0.0f, debugContext("zero"));
    g.setTileMapping(rootPartials, rootTile);
  } else {
    rootPartials = poplar::concat(children[root]);
  }
  poplar::ComputeSet bias = g.addComputeSet(debugContext("ScalingBias"));
  auto vertex = g.addVertex(bias,
                            poputil::templateVertex("ScalingBias", attributes.exponentBits()),
                            {{"partials", rootPartials},
                             {"log2Scale", scale.log2Scale},
                             {"nonFinite", scale.nonFinite}});
  g.setInitialValue(vertex["margin"], static_cast<int>(attributes.margin));
  g.setTileMapping(vertex, rootTile);
  prog.add(poplar::program::Execute(bias, debugContext("scalingBias")));
  return scale;
}

poplar::Tensor CodeletOpx::growCastToFp8(poplar::program::Sequence& prog,
                                         const poplar::Tensor& flat,
                                         const poplar::Tensor& log2Scale,
                                         const Fp8Attributes& attributes) const {
  poplar::Graph& g = graph();
  addFp8Codelets(g);
  const poplar::Tensor codes = g.clone(poplar::UNSIGNED_CHAR, flat, debugContext("codes"));
  const std::vector<TileRegions> regions = regionsByTile(g, codes);
  poplar::ComputeSet cast = g.addComputeSet(debugContext("CastToFp8"));
  const poplar::Type type = flat.elementType();
  const unsigned e = attributes.exponentBits();
  const std::string codelet = poputil::templateVertex("CastToFp8", type, e, attributes.saturate);
  const std::string regionsCodelet =
      poputil::templateVertex("CastToFp8Regions", type, e, attributes.saturate);
  for (unsigned t = 0; t < regions.size(); ++t) {
    if (regions[t].empty()) continue;
    auto vertex = addTileVertex(g, cast, codelet, regionsCodelet, t, regions[t],
                                {{"in", flat}, {"out", codes}});
    g.connect(vertex["log2Scale"], log2Scale);
  }
  prog.add(poplar::program::Execute(cast, debugContext("castToFp8")));
  return codes;
}

poplar::Tensor CodeletOpx::growCastFromFp8(poplar::program::Sequence& prog,
                                           const poplar::Tensor& codes,
                                           const poplar::Tensor& log2Scale,
                                           const poplar::Type& type,
                                           const Fp8Attributes& attributes) const {
  poplar::Graph& g = graph();
  addFp8Codelets(g);
  const poplar::Tensor values = g.clone(type, codes, debugContext("values"));
  const std::vector<TileRegions> regions = regionsByTile(g, values);
  poplar::ComputeSet decode = g.addComputeSet(debugContext("CastFromFp8"));
  const unsigned e = attributes.exponentBits();
  const std::string codelet = poputil::templateVertex("CastFromFp8", type, e);
  const std::string regionsCodelet = poputil::templateVertex("CastFromFp8Regions", type, e);
  for (unsigned t = 0; t < regions.size(); ++t) {
    if (regions[t].empty()) continue;
    auto vertex = addTileVertex(g, decode, codelet, regionsCodelet, t, regions[t],
                                {{"in", codes}, {"out", values}});
    g.connect(vertex["log2Scale"], log2Scale);
  }
  prog.add(poplar::program::Execute(decode, debugContext("castFromFp8")));
  return values;
}

poplar::Tensor CodeletOpx::growQuantise(poplar::program::Sequence& prog,
                                        const poplar::Tensor& x,
                                        const Fp8Attributes& attributes) const {
  const poplar::Tensor flat = x.flatten();
  // The non-finite flag is not an output here: s = 0 then, and the NaN or inf
  // carries on to the loss, where the training loop's NaN check reports it.
  const Scale scale = growScale(prog, flat, attributes);
  const poplar::Tensor codes = growCastToFp8(prog, flat, scale.log2Scale, attributes);
  const poplar::Tensor values =
      growCastFromFp8(prog, codes, scale.log2Scale, flat.elementType(), attributes);
  return values.reshape(x.shape());
}

}  // namespace ius_custom_ops
