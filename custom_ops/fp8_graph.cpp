// The Poplar graph around the FP8 codelets, shared by every FP8 custom op.
//
//   every tile holding input:  PartialAmax<T>        x slice  -> one partial per worker
//   tile 0:                    ScalingBias<E>        partials -> log2 scale, non-finite flag
//   every tile holding input:  CastToFp8<T, E, Sat>  x slice  -> uint8 codes
//   every tile holding codes:  CastFromFp8<T, E>     codes    -> decode(codes) * 2^-s
//
// Each tile's slice is ius::splitRange(n, tiles, tile); each MultiVertex splits
// its slice over the tile's workers with the same function.
#include <cstdlib>
#include <string>
#include <vector>

#include <poplar/Graph.hpp>
#include <poplar/Interval.hpp>
#include <poplar/Program.hpp>
#include <poputil/VertexTemplates.hpp>
#include <popart/error.hpp>
#include <popart/tensorinfo.hpp>

#include "fp8_ops.hpp"
#include "partition.hpp"

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

// Maps a flat tensor so tile t holds ius::splitRange(n, tiles, t).
void mapByPartition(poplar::Graph& graph, const poplar::Tensor& flat) {
  const unsigned tiles = graph.getTarget().getNumTiles();
  const std::size_t n = flat.numElements();
  for (unsigned t = 0; t < tiles; ++t) {
    const auto range = ius::splitRange<std::size_t>(n, tiles, t);
    if (range.end > range.begin) {
      graph.setTileMapping(flat.slice(range.begin, range.end), t);
    }
  }
}

bool laidOutByPartition(poplar::Graph& graph, const poplar::Tensor& flat) {
  const unsigned tiles = graph.getTarget().getNumTiles();
  const std::size_t n = flat.numElements();
  const auto mapping = graph.getTileMapping(flat, false);
  const std::vector<poplar::Interval> none;
  for (unsigned t = 0; t < tiles; ++t) {
    const auto range = ius::splitRange<std::size_t>(n, tiles, t);
    const bool empty = range.end == range.begin;
    const auto& intervals = t < mapping.size() ? mapping[t] : none;
    if (empty != intervals.empty()) return false;
    if (!empty && (intervals.size() != 1 || intervals[0].begin() != range.begin ||
                   intervals[0].end() != range.end)) {
      return false;
    }
  }
  return true;
}

// The popc-compiled codelets when the build made them, else the C++ source,
// which Poplar then compiles itself. IPU_UNIT_SCALING_CODELETS overrides both.
void addCodeletsOnce(poplar::Graph& graph) {
  if (graph.hasCodelet("PartialAmax<float>")) return;
  const char* override = std::getenv("IPU_UNIT_SCALING_CODELETS");
  const std::string precompiled = IUS_CODELETS_GP;
  const std::string directory = IUS_CODELETS_DIR;
  if (override != nullptr && *override != '\0') {
    graph.addCodelets(override, poplar::CodeletFileType::Auto, "-O3 -I" + directory);
  } else if (!precompiled.empty()) {
    graph.addCodelets(precompiled);
  } else {
    graph.addCodelets(directory + "/fp8_codelets.cpp", poplar::CodeletFileType::Auto,
                      "-O3 -I" + directory);
  }
}

poplar::Type poplarType(const popart::TensorInfo& info) {
  return info.dataType() == popart::DataType::FLOAT16 ? poplar::HALF : poplar::FLOAT;
}

}  // namespace

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

popart::popx::InputCreatorType CodeletOpx::getInputCreatorType(popart::InIndex index) const {
  return index == 0 ? popart::popx::InputCreatorType::CanCreate
                    : popart::popx::Opx::getInputCreatorType(index);
}

poplar::Tensor CodeletOpx::createInput(popart::InIndex index,
                                       const poplar::DebugNameAndId& dnai) const {
  if (index != 0) {
    throw popart::error("{} creates only its input 0, not {}", op_p->str(), index);
  }
  const popart::TensorInfo& info = inInfo(index);
  const std::vector<std::size_t> shape(info.shape().begin(), info.shape().end());
  poplar::Tensor input = graph().addVariable(poplarType(info), shape, dnai);
  mapByPartition(graph(), input.flatten());
  return input;
}

std::set<popart::TensorId> CodeletOpx::mustExistBeforeCreate(popart::InIndex) const {
  return {};
}

poplar::Tensor CodeletOpx::laidOutFlat(poplar::program::Sequence& prog,
                                       const poplar::Tensor& x) const {
  poplar::Graph& g = graph();
  const poplar::Tensor flat = x.flatten();
  if (laidOutByPartition(g, flat)) return flat;
  poplar::Tensor laidOut =
      g.addVariable(flat.elementType(), {flat.numElements()}, debugContext("input"));
  mapByPartition(g, laidOut);
  prog.add(poplar::program::Copy(flat, laidOut, false, debugContext("layout")));
  return laidOut;
}

CodeletOpx::Scale CodeletOpx::growScale(poplar::program::Sequence& prog,
                                        const poplar::Tensor& flat,
                                        const Fp8Attributes& attributes) const {
  poplar::Graph& g = graph();
  addCodeletsOnce(g);
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
  g.setTileMapping(scale.log2Scale, 0);
  g.setTileMapping(scale.nonFinite, 0);

  const unsigned tiles = g.getTarget().getNumTiles();
  const unsigned workers = g.getTarget().getNumWorkerContexts();
  const std::size_t n = flat.numElements();
  poplar::ComputeSet amax = g.addComputeSet(debugContext("PartialAmax"));
  const std::string amaxVertex = poputil::templateVertex("PartialAmax", flat.elementType());
  std::vector<poplar::Tensor> usedPartials;
  for (unsigned t = 0; t < tiles; ++t) {
    const auto range = ius::splitRange<std::size_t>(n, tiles, t);
    if (range.end == range.begin) continue;  // empty tiles hold no vertex, no partials
    poplar::Tensor partials = g.addVariable(poplar::FLOAT, {workers}, debugContext("partials"));
    g.setTileMapping(partials, t);
    auto vertex = g.addVertex(amax, amaxVertex,
                              {{"in", flat.slice(range.begin, range.end)},
                               {"partials", partials}});
    g.setTileMapping(vertex, t);
    usedPartials.push_back(partials);
  }
  prog.add(poplar::program::Execute(amax, debugContext("amax")));

  poplar::ComputeSet reduce = g.addComputeSet(debugContext("ScalingBias"));
  poplar::Tensor allPartials =
      usedPartials.empty() ? g.addConstant(poplar::FLOAT, {1}, 0.0f, debugContext("zero"))
                           : poplar::concat(usedPartials);
  if (usedPartials.empty()) g.setTileMapping(allPartials, 0);
  auto vertex = g.addVertex(reduce,
                            poputil::templateVertex("ScalingBias", attributes.exponentBits()),
                            {{"partials", allPartials},
                             {"log2Scale", scale.log2Scale},
                             {"nonFinite", scale.nonFinite}});
  g.setInitialValue(vertex["margin"], static_cast<int>(attributes.margin));
  g.setTileMapping(vertex, 0);
  prog.add(poplar::program::Execute(reduce, debugContext("scalingBias")));
  return scale;
}

poplar::Tensor CodeletOpx::growCastToFp8(poplar::program::Sequence& prog,
                                         const poplar::Tensor& flat,
                                         const poplar::Tensor& log2Scale,
                                         const Fp8Attributes& attributes) const {
  poplar::Graph& g = graph();
  addCodeletsOnce(g);
  const unsigned tiles = g.getTarget().getNumTiles();
  const std::size_t n = flat.numElements();
  poplar::Tensor codes = g.addVariable(poplar::UNSIGNED_CHAR, {n}, debugContext("codes"));
  mapByPartition(g, codes);
  poplar::ComputeSet cast = g.addComputeSet(debugContext("CastToFp8"));
  const std::string vertexName = poputil::templateVertex(
      "CastToFp8", flat.elementType(), attributes.exponentBits(), attributes.saturate);
  for (unsigned t = 0; t < tiles; ++t) {
    const auto range = ius::splitRange<std::size_t>(n, tiles, t);
    if (range.end == range.begin) continue;
    auto vertex = g.addVertex(cast, vertexName,
                              {{"in", flat.slice(range.begin, range.end)},
                               {"log2Scale", log2Scale},
                               {"out", codes.slice(range.begin, range.end)}});
    g.setTileMapping(vertex, t);
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
  addCodeletsOnce(g);
  const unsigned tiles = g.getTarget().getNumTiles();
  const std::size_t n = codes.numElements();
  poplar::Tensor values = g.addVariable(type, {n}, debugContext("values"));
  mapByPartition(g, values);
  poplar::ComputeSet decode = g.addComputeSet(debugContext("CastFromFp8"));
  const std::string vertexName =
      poputil::templateVertex("CastFromFp8", type, attributes.exponentBits());
  for (unsigned t = 0; t < tiles; ++t) {
    const auto range = ius::splitRange<std::size_t>(n, tiles, t);
    if (range.end == range.begin) continue;
    auto vertex = g.addVertex(decode, vertexName,
                              {{"in", codes.slice(range.begin, range.end)},
                               {"log2Scale", log2Scale},
                               {"out", values.slice(range.begin, range.end)}});
    g.setTileMapping(vertex, t);
  }
  prog.add(poplar::program::Execute(decode, debugContext("castFromFp8")));
  return values;
}

poplar::Tensor CodeletOpx::growQuantise(poplar::program::Sequence& prog,
                                        const poplar::Tensor& x,
                                        const Fp8Attributes& attributes) const {
  const poplar::Tensor flat = laidOutFlat(prog, x);
  // The non-finite flag is not an output here: s = 0 then, and the NaN or inf
  // carries on to the loss, where the training loop's NaN check reports it.
  const Scale scale = growScale(prog, flat, attributes);
  const poplar::Tensor codes = growCastToFp8(prog, flat, scale.log2Scale, attributes);
  const poplar::Tensor values =
      growCastFromFp8(prog, codes, scale.log2Scale, flat.elementType(), attributes);
  return values.reshape(x.shape());
}

}  // namespace ius_custom_ops
