// PopART custom op: tile-local FP8 amax, scaling bias and cast.
//
//   codes, log2_scale, non_finite = Fp8AmaxCast(x)
//     domain "ai.graphcore.unit_scaling", version 1
//     attributes: format "F143" | "F152", margin (int), saturate (0 | 1),
//                 log2_scale (int, used when has_log2_scale == 1)
//
// codes (uint8, x's shape) = encode(x * 2^s), log2_scale (int32 scalar) = s with
// s = clamp(floor(log2(max / amax)) - margin, -31, 31) (s = 0 for amax 0). A vertex
// cannot raise, so a non-finite amax gives s = 0 and non_finite = 1 for the
// host to check. Poplar's QuarterMetadata scale is -s.
//
// The graph: the input is laid out with ius::splitRange (codelets/partition.hpp)
// over all tiles, one PartialAmax vertex per tile holding input, one ScalingBias
// vertex on tile 0 over the partials, then one CastToFp8 vertex per tile. Each
// MultiVertex splits its slice over the tile's workers with the same function;
// the Python emulator runs these vertices on the host with the same split.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <poplar/Graph.hpp>
#include <poplar/Program.hpp>
#include <poputil/VertexTemplates.hpp>
#include <popart/error.hpp>
#include <popart/op.hpp>
#include <popart/opmanager.hpp>
#include <popart/opserialiser.hpp>
#include <popart/popx/opx.hpp>
#include <popart/popx/opxmanager.hpp>

#include "partition.hpp"

#ifndef IUS_CODELETS_GP
#define IUS_CODELETS_GP ""
#endif
#ifndef IUS_CODELETS_DIR
#define IUS_CODELETS_DIR ""
#endif

namespace ius_custom_ops {

const popart::OperatorIdentifier kFp8AmaxCast = {"ai.graphcore.unit_scaling", "Fp8AmaxCast",
                                                 1, 1, 3};

struct CastAttributes {
  std::string format = "F143";
  int64_t margin = 0;
  bool saturate = true;
  bool hasLog2Scale = false;
  int64_t log2Scale = 0;

  unsigned exponentBits() const { return format == "F152" ? 5u : 4u; }
};

class Fp8AmaxCastOp : public popart::Op {
 public:
  Fp8AmaxCastOp(const popart::OperatorIdentifier& opid, const CastAttributes& attributes,
                const popart::Op::Settings& settings)
      : popart::Op(opid, settings), attributes_(attributes) {}

  void setup() override {
    if (attributes_.format != "F143" && attributes_.format != "F152") {
      throw popart::error("Fp8AmaxCast: format must be F143 or F152, got {}",
                          attributes_.format);
    }
    outInfo(0) = popart::TensorInfo(popart::DataType::UINT8, inInfo(0).shape());
    outInfo(1) = popart::TensorInfo(popart::DataType::INT32, popart::Shape{});
    outInfo(2) = popart::TensorInfo(popart::DataType::INT32, popart::Shape{});
  }

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8AmaxCastOp>(*this);
  }

  float getSubgraphValue() const final { return getLowSubgraphValue(); }

  void appendAttributes(popart::OpSerialiserBase& os) const override {
    popart::Op::appendAttributes(os);
    os.appendAttribute("format", attributes_.format);
    os.appendAttribute("margin", attributes_.margin);
    os.appendAttribute("saturate", static_cast<int64_t>(attributes_.saturate));
    os.appendAttribute("has_log2_scale", static_cast<int64_t>(attributes_.hasLog2Scale));
    os.appendAttribute("log2_scale", attributes_.log2Scale);
  }

  const CastAttributes& attributes() const { return attributes_; }

 private:
  CastAttributes attributes_;
};

const popart::OpDefinition::DataTypes kInputTypes = {popart::DataType::FLOAT,
                                                     popart::DataType::FLOAT16};

popart::OpCreator<Fp8AmaxCastOp> fp8AmaxCastOpCreator(
    popart::OpDefinitions({{kFp8AmaxCast,
                            {popart::OpDefinition::Inputs({{"x", kInputTypes}}),
                             popart::OpDefinition::Outputs({{"codes", {popart::DataType::UINT8}},
                                                            {"log2_scale", {popart::DataType::INT32}},
                                                            {"non_finite", {popart::DataType::INT32}}}),
                             popart::OpDefinition::Attributes({{"format", {"*"}},
                                                               {"margin", {"*"}},
                                                               {"saturate", {"*"}},
                                                               {"has_log2_scale", {"*"}},
                                                               {"log2_scale", {"*"}}})}}}),
    [](const popart::OpCreatorInfo& info) {
      CastAttributes attributes;
      attributes.format =
          info.attributes.getAttribute<popart::Attributes::String>("format", "F143");
      attributes.margin = info.attributes.getAttribute<popart::Attributes::Int>("margin", 0);
      attributes.saturate =
          info.attributes.getAttribute<popart::Attributes::Int>("saturate", 1) != 0;
      attributes.hasLog2Scale =
          info.attributes.getAttribute<popart::Attributes::Int>("has_log2_scale", 0) != 0;
      attributes.log2Scale =
          info.attributes.getAttribute<popart::Attributes::Int>("log2_scale", 0);
      return std::unique_ptr<popart::Op>(
          new Fp8AmaxCastOp(info.opid, attributes, info.settings));
    },
    true);

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
  for (unsigned t = 0; t < tiles; ++t) {
    const auto range = ius::splitRange<std::size_t>(n, tiles, t);
    const bool empty = range.end == range.begin;
    const std::vector<poplar::Interval> none;
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

class Fp8AmaxCastOpx : public popart::popx::Opx {
 public:
  Fp8AmaxCastOpx(popart::Op* op, popart::popx::Devicex* devicex)
      : popart::popx::Opx(op, devicex) {
    verifyOp<Fp8AmaxCastOp>(op, kFp8AmaxCast);
  }

  // Creating the input lets producers write it straight into the partition's
  // layout, so grow() needs no rearranging copy.
  popart::popx::InputCreatorType getInputCreatorType(popart::InIndex) const override {
    return popart::popx::InputCreatorType::CanCreate;
  }

  poplar::Tensor createInput(popart::InIndex index,
                             const poplar::DebugNameAndId& dnai) const override {
    const popart::TensorInfo& info = inInfo(index);
    const poplar::Type type =
        info.dataType() == popart::DataType::FLOAT16 ? poplar::HALF : poplar::FLOAT;
    std::vector<std::size_t> shape(info.shape().begin(), info.shape().end());
    poplar::Tensor input = graph().addVariable(type, shape, dnai);
    mapByPartition(graph(), input.flatten());
    return input;
  }

  std::set<popart::TensorId> mustExistBeforeCreate(popart::InIndex) const override {
    return {};
  }

  void grow(poplar::program::Sequence& prog) const final {
    poplar::Graph& g = graph();
    addCodeletsOnce(g);
    const CastAttributes& attributes = getOp<Fp8AmaxCastOp>().attributes();
    const unsigned tiles = g.getTarget().getNumTiles();
    const unsigned workers = g.getTarget().getNumWorkerContexts();
    const unsigned exponentBits = attributes.exponentBits();

    const poplar::Tensor input = getInTensor(0);
    poplar::Tensor x = input.flatten();
    const std::size_t n = x.numElements();
    if (!laidOutByPartition(g, x)) {
      poplar::Tensor laidOut = g.addVariable(x.elementType(), {n}, debugContext("input"));
      mapByPartition(g, laidOut);
      prog.add(poplar::program::Copy(x, laidOut, false, debugContext("layout")));
      x = laidOut;
    }

    poplar::Tensor log2Scale;
    poplar::Tensor nonFinite;
    if (attributes.hasLog2Scale) {
      log2Scale = g.addConstant(poplar::INT, {}, static_cast<int>(attributes.log2Scale),
                                debugContext("log2Scale"));
      nonFinite = g.addConstant(poplar::INT, {}, 0, debugContext("nonFinite"));
      g.setTileMapping(log2Scale, 0);
      g.setTileMapping(nonFinite, 0);
    } else {
      log2Scale = g.addVariable(poplar::INT, {}, debugContext("log2Scale"));
      nonFinite = g.addVariable(poplar::INT, {}, debugContext("nonFinite"));
      g.setTileMapping(log2Scale, 0);
      g.setTileMapping(nonFinite, 0);
      growAmaxAndScale(g, prog, x, tiles, workers, exponentBits,
                       static_cast<int>(attributes.margin), log2Scale, nonFinite);
    }

    poplar::Tensor codes = g.addVariable(poplar::UNSIGNED_CHAR, {n}, debugContext("codes"));
    mapByPartition(g, codes);
    poplar::ComputeSet cast = g.addComputeSet(debugContext("CastToFp8"));
    const std::string castVertex = poputil::templateVertex(
        "CastToFp8", x.elementType(), exponentBits, attributes.saturate);
    for (unsigned t = 0; t < tiles; ++t) {
      const auto range = ius::splitRange<std::size_t>(n, tiles, t);
      if (range.end == range.begin) continue;
      auto vertex = g.addVertex(cast, castVertex,
                                {{"in", x.slice(range.begin, range.end)},
                                 {"log2Scale", log2Scale},
                                 {"out", codes.slice(range.begin, range.end)}});
      g.setTileMapping(vertex, t);
    }
    prog.add(poplar::program::Execute(cast, debugContext("cast")));

    setOutTensor(0, codes.reshape(input.shape()));
    setOutTensor(1, log2Scale);
    setOutTensor(2, nonFinite);
  }

 private:
  void growAmaxAndScale(poplar::Graph& g, poplar::program::Sequence& prog,
                        const poplar::Tensor& x, unsigned tiles, unsigned workers,
                        unsigned exponentBits, int margin, const poplar::Tensor& log2Scale,
                        const poplar::Tensor& nonFinite) const {
    const std::size_t n = x.numElements();
    poplar::ComputeSet amax = g.addComputeSet(debugContext("PartialAmax"));
    const std::string amaxVertex = poputil::templateVertex("PartialAmax", x.elementType());
    std::vector<poplar::Tensor> usedPartials;
    for (unsigned t = 0; t < tiles; ++t) {
      const auto range = ius::splitRange<std::size_t>(n, tiles, t);
      if (range.end == range.begin) continue;  // empty tiles hold no vertex, no partials
      poplar::Tensor partials =
          g.addVariable(poplar::FLOAT, {workers}, debugContext("partials"));
      g.setTileMapping(partials, t);
      auto vertex = g.addVertex(amax, amaxVertex,
                                {{"in", x.slice(range.begin, range.end)},
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
    auto vertex = g.addVertex(reduce, poputil::templateVertex("ScalingBias", exponentBits),
                              {{"partials", allPartials},
                               {"log2Scale", log2Scale},
                               {"nonFinite", nonFinite}});
    g.setInitialValue(vertex["margin"], margin);
    g.setTileMapping(vertex, 0);
    prog.add(poplar::program::Execute(reduce, debugContext("scalingBias")));
  }
};

popart::popx::OpxCreator<Fp8AmaxCastOpx> fp8AmaxCastOpxCreator(kFp8AmaxCast);

}  // namespace ius_custom_ops
