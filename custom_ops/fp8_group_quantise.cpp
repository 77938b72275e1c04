// PopART custom op for the grouped FP8 recipes (rowwise, block, MX).
//
//   y, log2_scales, non_finite = Fp8GroupQuantise(x)
//     domain "ai.graphcore.unit_scaling", version 1
//     x: 2-D float32 | float16, groups along its last dimension
//     attributes: format "F143" | "F152" | "E4M3FN" | "E5M2",
//                 grouping "row" | "tile" | "block", group_size (>= 1; not for "row"),
//                 rule "amax" | "mx", scale_rounding "floor" | "up" (for "mx"),
//                 margin (0..31, for "amax"), saturate (0 | 1; 1 for "mx" and the OCP formats)
//     y = decode(cast(x * 2^s)) * 2^-s in x's type and shape, s per group;
//     log2_scales, non_finite: int32, one per group, shaped as the grouped view
//       with the group's own axes of size 1 (row: [rows, 1]; tile: [rows, tiles, 1];
//       block: [block rows, 1, block columns, 1]), as group_cast returns them.
//     Fp8GroupQuantiseGrad: dx = dy (straight through).
//
//   y = Fp8GroupGradientQuantise(x)   the same attributes
//     y = x.
//     Fp8GroupGradientQuantiseGrad: dx = decode(cast(dy * 2^s)) * 2^-s, s per
//       group of dy: the gradient is cast as Fp8GroupQuantise casts its input.
//       (A traced grouped-recipe linear casts each GEMM's output gradient so;
//       ipu_unit_scaling/fp8/recipe_linear.py.)
//
// Each group lies whole on one tile (ius::planGroups, dealt to the tiles in
// runs that differ by at most one group), so its amax is that tile's and no
// partial is exchanged: GroupCastToFp8 then GroupCastFromFp8 on every tile
// holding groups (codelets/fp8_block_codelets.cpp). x is copied into that
// layout once, each tile's segments in one variable, each segment starting on
// an 8-element boundary (the vertices' sub-word outputs are 8-byte aligned);
// y is a view of the values in x's order, with no second copy. A group whose
// amax is inf or NaN gets s = 0 and non_finite = 1: a vertex cannot raise.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <poplar/Graph.hpp>
#include <poplar/Program.hpp>
#include <poputil/VertexTemplates.hpp>
#include <popart/error.hpp>
#include <popart/op.hpp>
#include <popart/opmanager.hpp>
#include <popart/popx/opxmanager.hpp>
#include <popart/shapeinference.hpp>

#include "fp8_arith.hpp"
#include "fp8_ops.hpp"
#include "placement.hpp"

namespace ius_custom_ops {

namespace {

constexpr int64_t kMaxMargin = 31;
constexpr std::int64_t kGrain = ius::kPartitionGrain;

struct GroupAttributes {
  std::string format = "F143";
  std::string grouping = "tile";
  int64_t groupSize = 128;
  std::string rule = "amax";
  std::string scaleRounding = "floor";
  int64_t margin = 0;
  bool saturate = true;

  static GroupAttributes read(const popart::Attributes& attributes) {
    GroupAttributes result;
    using popart::Attributes;
    result.format = attributes.getAttribute<Attributes::String>("format", result.format);
    result.grouping = attributes.getAttribute<Attributes::String>("grouping", result.grouping);
    result.groupSize = attributes.getAttribute<Attributes::Int>("group_size", result.groupSize);
    result.rule = attributes.getAttribute<Attributes::String>("rule", result.rule);
    result.scaleRounding =
        attributes.getAttribute<Attributes::String>("scale_rounding", result.scaleRounding);
    result.margin = attributes.getAttribute<Attributes::Int>("margin", 0);
    result.saturate = attributes.getAttribute<Attributes::Int>("saturate", 1) != 0;
    return result;
  }

  bool ocp() const { return format == "E4M3FN" || format == "E5M2"; }
  unsigned exponentBits() const { return format == "F152" || format == "E5M2" ? 5u : 4u; }
  int kind() const {
    return grouping == "row" ? ius::kGroupRow
                             : grouping == "tile" ? ius::kGroupTile : ius::kGroupBlock;
  }
  int vertexRule() const {
    if (rule == "amax") return ius::kRuleAmax;
    return scaleRounding == "up" ? ius::kRuleMxUp : ius::kRuleMxFloor;
  }

  void validate(const popart::Shape& shape) const {
    const char* op = "Fp8GroupQuantise";
    if (format != "F143" && format != "F152" && !ocp()) {
      throw popart::error("{}: format must be F143, F152, E4M3FN or E5M2, got {}", op, format);
    }
    if (grouping != "row" && grouping != "tile" && grouping != "block") {
      throw popart::error("{}: grouping must be row, tile or block, got {}", op, grouping);
    }
    if (grouping != "row" && groupSize < 1) {
      throw popart::error("{}: group_size must be >= 1, got {}", op, groupSize);
    }
    if (!(rule == "amax" && scaleRounding == "floor") &&
        !(rule == "mx" && (scaleRounding == "floor" || scaleRounding == "up"))) {
      throw popart::error("{}: rule must be amax (scale_rounding floor) or mx (floor or up), "
                          "got {} ({})", op, rule, scaleRounding);
    }
    if (margin < 0 || margin > kMaxMargin) {
      throw popart::error("{}: margin must be in 0..{}, got {}", op, kMaxMargin, margin);
    }
    if (!saturate && (ocp() || rule == "mx")) {
      throw popart::error("{}: {} elements with rule {} saturate: saturate must be 1", op,
                          format, rule);
    }
    if (shape.size() != 2) {
      throw popart::error("{}: x must be 2-D (groups along its last dimension), got rank {}",
                          op, shape.size());
    }
  }

  // The per-group outputs' shape, as group_cast shapes its scales.
  popart::Shape scaleShape(const popart::Shape& shape) const {
    const int64_t rows = shape[0], cols = shape[1];
    const int64_t size = grouping == "row" ? std::max<int64_t>(cols, 1) : groupSize;
    const int64_t perRow = (cols + size - 1) / size;
    if (grouping == "row") return {rows, 1};
    if (grouping == "tile") return {rows, perRow, 1};
    return {(rows + size - 1) / size, 1, perRow, 1};
  }

  void appendTo(popart::OpSerialiserBase& os) const {
    os.appendAttribute("format", format);
    os.appendAttribute("grouping", grouping);
    os.appendAttribute("group_size", groupSize);
    os.appendAttribute("rule", rule);
    os.appendAttribute("scale_rounding", scaleRounding);
    os.appendAttribute("margin", margin);
    os.appendAttribute("saturate", static_cast<int64_t>(saturate));
  }
};

const popart::OperatorIdentifier kFp8GroupQuantise = {kDomain, "Fp8GroupQuantise", 1, 1, 3};
const popart::OperatorIdentifier kFp8GroupQuantiseGrad = {kDomain, "Fp8GroupQuantiseGrad", 1,
                                                          1, 1};
const popart::OperatorIdentifier kFp8GroupGradientQuantise = {kDomain,
                                                              "Fp8GroupGradientQuantise", 1, 1, 1};
const popart::OperatorIdentifier kFp8GroupGradientQuantiseGrad = {kDomain,
                                                                  "Fp8GroupGradientQuantiseGrad",
                                                                  1, 1, 1};

}  // namespace

// An op with the grouped cast's attributes.
class GroupCastOp : public popart::Op {
 public:
  GroupCastOp(const popart::OperatorIdentifier& opid, const GroupAttributes& attributes,
              const popart::Op::Settings& settings)
      : popart::Op(opid, settings), attributes_(attributes) {}

  float getSubgraphValue() const final { return getLowSubgraphValue(); }
  void appendOutlineAttributes(popart::OpSerialiserBase& os) const final {
    popart::Op::appendOutlineAttributes(os);
    attributes_.appendTo(os);
  }
  const GroupAttributes& attributes() const { return attributes_; }

 private:
  GroupAttributes attributes_;
};

// The grad ops of both: Fp8GroupQuantiseGrad and Fp8GroupGradientQuantiseGrad,
// told apart by their identifier. Each reads the gradient of output 0 (y)
// only (the scales and flags have none) and gives the gradient of input 0.
class GroupGradOp : public GroupCastOp {
 public:
  GroupGradOp(const popart::OperatorIdentifier& opid, const GroupCastOp& forward)
      : GroupCastOp(opid, forward.attributes(), forward.settings) {}

  void setup() final { outInfo(0) = inInfo(0); }
  std::unique_ptr<popart::Op> clone() const final { return std::make_unique<GroupGradOp>(*this); }
  const std::vector<popart::GradInOutMapper>& gradInputInfo() const final {
    static const std::vector<popart::GradInOutMapper> info = {
        {0, 0, popart::GradOpInType::GradOut}};
    return info;
  }
  const std::map<int, int>& gradOutToNonGradIn() const final {
    static const std::map<int, int> info = {{0, 0}};
    return info;
  }
};

class Fp8GroupQuantiseOp : public GroupCastOp {
 public:
  using GroupCastOp::GroupCastOp;

  void setup() final {
    attributes().validate(inInfo(0).shape());
    const popart::Shape scales = attributes().scaleShape(inInfo(0).shape());
    outInfo(0) = inInfo(0);
    outInfo(1) = popart::TensorInfo(popart::DataType::INT32, scales);
    outInfo(2) = popart::TensorInfo(popart::DataType::INT32, scales);
  }
  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8GroupQuantiseOp>(*this);
  }
  std::vector<std::unique_ptr<popart::Op>> getGradOps() final {
    std::vector<std::unique_ptr<popart::Op>> gradOps;
    gradOps.push_back(std::make_unique<GroupGradOp>(kFp8GroupQuantiseGrad, *this));
    return gradOps;
  }
};

class Fp8GroupGradientQuantiseOp : public GroupCastOp {
 public:
  using GroupCastOp::GroupCastOp;

  void setup() final {
    attributes().validate(inInfo(0).shape());
    outInfo(0) = inInfo(0);
  }
  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8GroupGradientQuantiseOp>(*this);
  }
  std::vector<std::unique_ptr<popart::Op>> getGradOps() final {
    std::vector<std::unique_ptr<popart::Op>> gradOps;
    gradOps.push_back(std::make_unique<GroupGradOp>(kFp8GroupGradientQuantiseGrad, *this));
    return gradOps;
  }
};

namespace {

const popart::OpDefinition::DataTypes kFloatTypes = {popart::DataType::FLOAT,
                                                     popart::DataType::FLOAT16};

popart::OpCreator<Fp8GroupQuantiseOp> fp8GroupQuantiseOpCreator(
    popart::OpDefinitions(
        {{kFp8GroupQuantise,
          {popart::OpDefinition::Inputs({{"x", kFloatTypes}}),
           popart::OpDefinition::Outputs({{"y", kFloatTypes},
                                          {"log2_scales", {popart::DataType::INT32}},
                                          {"non_finite", {popart::DataType::INT32}}}),
           popart::OpDefinition::Attributes({{"format", {"*"}},
                                             {"grouping", {"*"}},
                                             {"group_size", {"*"}},
                                             {"rule", {"*"}},
                                             {"scale_rounding", {"*"}},
                                             {"margin", {"*"}},
                                             {"saturate", {"*"}}})}}}),
    [](const popart::OpCreatorInfo& info) -> std::unique_ptr<popart::Op> {
      return std::make_unique<Fp8GroupQuantiseOp>(
          info.opid, GroupAttributes::read(info.attributes), info.settings);
    },
    true);

popart::RegisterShapeInferenceFunction fp8GroupQuantiseShapeInference(
    kFp8GroupQuantise, [](popart::ShapeInferenceContext& ctx) {
      const GroupAttributes attributes = GroupAttributes::read(ctx.getAttributes());
      const popart::Shape scales = attributes.scaleShape(ctx.inShape(0));
      ctx.outInfo(0) = {ctx.inType(0), ctx.inShape(0)};
      ctx.outInfo(1) = {popart::DataType::INT32, scales};
      ctx.outInfo(2) = {popart::DataType::INT32, scales};
    });

popart::OpCreator<Fp8GroupGradientQuantiseOp> fp8GroupGradientQuantiseOpCreator(
    popart::OpDefinitions(
        {{kFp8GroupGradientQuantise,
          {popart::OpDefinition::Inputs({{"x", kFloatTypes}}),
           popart::OpDefinition::Outputs({{"y", kFloatTypes}}),
           popart::OpDefinition::Attributes({{"format", {"*"}},
                                             {"grouping", {"*"}},
                                             {"group_size", {"*"}},
                                             {"rule", {"*"}},
                                             {"scale_rounding", {"*"}},
                                             {"margin", {"*"}},
                                             {"saturate", {"*"}}})}}}),
    [](const popart::OpCreatorInfo& info) -> std::unique_ptr<popart::Op> {
      return std::make_unique<Fp8GroupGradientQuantiseOp>(
          info.opid, GroupAttributes::read(info.attributes), info.settings);
    },
    true);

popart::RegisterShapeInferenceFunction fp8GroupGradientQuantiseShapeInference(
    kFp8GroupGradientQuantise, [](popart::ShapeInferenceContext& ctx) {
      ctx.outInfo(0) = {ctx.inType(0), ctx.inShape(0)};
    });

// One tensor's segments, each tile's in one padded variable: the views of
// the segments in plan order.
std::vector<poplar::Tensor> segmentViews(poplar::Graph& graph, const poplar::Type& type,
                                         const ius::GroupPlan& plan,
                                         const std::vector<ius::Range<std::int64_t>>& tileSegments,
                                         const poplar::DebugContext& debug) {
  std::vector<poplar::Tensor> views(plan.starts.size());
  for (std::size_t tile = 0; tile < tileSegments.size(); ++tile) {
    const auto segments = tileSegments[tile];
    if (segments.end == segments.begin) continue;
    std::int64_t size = 0;
    for (std::int64_t s = segments.begin; s < segments.end; ++s) {
      size += (plan.lengths[s] + kGrain - 1) / kGrain * kGrain;
    }
    const poplar::Tensor memory =
        graph.addVariable(type, {static_cast<std::size_t>(size)}, debug);
    graph.setTileMapping(memory, static_cast<unsigned>(tile));
    std::int64_t offset = 0;
    for (std::int64_t s = segments.begin; s < segments.end; ++s) {
      views[s] = memory.slice(offset, offset + plan.lengths[s]);
      offset += (plan.lengths[s] + kGrain - 1) / kGrain * kGrain;
    }
  }
  return views;
}

// The segment views in the flat tensor's element order (the segments
// partition it): a view of the whole tensor.
poplar::Tensor inTensorOrder(const std::vector<poplar::Tensor>& views,
                             const std::vector<std::size_t>& byStart) {
  std::vector<poplar::Tensor> ordered;
  ordered.reserve(views.size());
  for (std::size_t s : byStart) ordered.push_back(views[s]);
  return poplar::concat(ordered);
}

}  // namespace

// The grouped cast's outputs: values in x's type and shape, and per group the
// scales and non-finite flags.
struct GroupCastTensors {
  poplar::Tensor values;
  poplar::Tensor log2Scales;
  poplar::Tensor nonFinite;
};

// An Opx that grows the grouped cast (Fp8GroupQuantise's graph) on a tensor.
class GroupCastOpx : public popart::popx::Opx {
 public:
  using popart::popx::Opx::Opx;

 protected:
  GroupCastTensors growGroupCast(poplar::program::Sequence& prog, const poplar::Tensor& x,
                                 const GroupAttributes& attributes) const {
    poplar::Graph& g = graph();
    addFp8Codelets(g);
    const popart::Shape shape = {static_cast<int64_t>(x.dim(0)),
                                 static_cast<int64_t>(x.dim(1))};
    const popart::Shape scaleShape = attributes.scaleShape(shape);
    const auto rows = static_cast<std::int64_t>(x.dim(0));
    const auto cols = static_cast<std::int64_t>(x.dim(1));
    const std::vector<std::size_t> scaleDims(scaleShape.begin(), scaleShape.end());
    if (x.numElements() == 0) {  // no vertex runs; a group without elements has amax 0
      const int emptyScale = attributes.rule == "amax" ? 0 : ius::kMxScaleLimit;
      const poplar::Tensor scales =
          g.addConstant(poplar::INT, scaleDims, emptyScale, debugContext("log2Scales"));
      const poplar::Tensor flags =
          g.addConstant(poplar::INT, scaleDims, 0, debugContext("nonFinite"));
      g.setTileMapping(scales, 0);
      g.setTileMapping(flags, 0);
      return {g.clone(x, debugContext("empty")), scales, flags};
    }
    const ius::GroupPlan plan = ius::planGroups(rows, cols, attributes.kind(),
                                                attributes.groupSize);
    const std::size_t groups = plan.groupEnds.size();
    const unsigned tiles = g.getTarget().getNumTiles();

    std::vector<ius::Range<std::int64_t>> tileGroups(tiles), tileSegments(tiles);
    for (unsigned t = 0; t < tiles; ++t) {
      tileGroups[t] = ius::splitRange<std::int64_t>(static_cast<std::int64_t>(groups), tiles, t,
                                                    1);
      const auto run = tileGroups[t];
      tileSegments[t] = {run.begin == 0 ? 0 : plan.groupEnds[run.begin - 1],
                         run.end == 0 ? 0 : plan.groupEnds[run.end - 1]};
    }
    std::vector<std::size_t> byStart(plan.starts.size());
    std::iota(byStart.begin(), byStart.end(), 0);
    std::sort(byStart.begin(), byStart.end(),
              [&](std::size_t a, std::size_t b) { return plan.starts[a] < plan.starts[b]; });

    const poplar::Type type = x.elementType();
    const auto in = segmentViews(g, type, plan, tileSegments, debugContext("groupedInput"));
    const auto codes =
        segmentViews(g, poplar::UNSIGNED_CHAR, plan, tileSegments, debugContext("codes"));
    const auto values = segmentViews(g, type, plan, tileSegments, debugContext("values"));
    prog.add(poplar::program::Copy(x.flatten(), inTensorOrder(in, byStart), false,
                                   debugContext("toGroupLayout")));

    const poplar::Tensor scales =
        g.addVariable(poplar::INT, {groups}, debugContext("log2Scales"));
    const poplar::Tensor flags = g.addVariable(poplar::INT, {groups}, debugContext("nonFinite"));
    poplar::ComputeSet castTo = g.addComputeSet(debugContext("GroupCastToFp8"));
    poplar::ComputeSet castFrom = g.addComputeSet(debugContext("GroupCastFromFp8"));
    const unsigned e = attributes.exponentBits();
    const std::string toCodelet = poputil::templateVertex("GroupCastToFp8", type, e,
                                                          attributes.saturate, attributes.ocp());
    const std::string fromCodelet =
        poputil::templateVertex("GroupCastFromFp8", type, e, attributes.ocp());
    for (unsigned t = 0; t < tiles; ++t) {
      const auto run = tileGroups[t];
      if (run.end == run.begin) continue;
      const auto segs = tileSegments[t];
      std::vector<unsigned> ends;
      for (std::int64_t gi = run.begin; gi < run.end; ++gi) {
        ends.push_back(static_cast<unsigned>(plan.groupEnds[gi] - segs.begin));
      }
      const poplar::Tensor groupEnds =
          g.addConstant<unsigned>(poplar::UNSIGNED_INT, {ends.size()}, ends,
                                  debugContext("groupEnds"));
      g.setTileMapping(groupEnds, t);
      const poplar::Tensor tileScales = scales.slice(run.begin, run.end);
      g.setTileMapping(tileScales, t);
      g.setTileMapping(flags.slice(run.begin, run.end), t);
      const std::vector<poplar::Tensor> tileIn(in.begin() + segs.begin, in.begin() + segs.end);
      const std::vector<poplar::Tensor> tileCodes(codes.begin() + segs.begin,
                                                  codes.begin() + segs.end);
      const std::vector<poplar::Tensor> tileValues(values.begin() + segs.begin,
                                                   values.begin() + segs.end);

      auto to = g.addVertex(castTo, toCodelet);
      g.connect(to["in"], tileIn);
      g.connect(to["out"], tileCodes);
      g.connect(to["groupEnds"], groupEnds);
      g.connect(to["log2Scales"], tileScales);
      g.connect(to["nonFinite"], flags.slice(run.begin, run.end));
      g.setInitialValue(to["rule"], attributes.vertexRule());
      g.setInitialValue(to["margin"], static_cast<int>(attributes.margin));
      g.setTileMapping(to, t);

      auto from = g.addVertex(castFrom, fromCodelet);
      g.connect(from["in"], tileCodes);
      g.connect(from["out"], tileValues);
      g.connect(from["groupEnds"], groupEnds);
      g.connect(from["log2Scales"], tileScales);
      g.setTileMapping(from, t);
    }
    prog.add(poplar::program::Execute(castTo, debugContext("groupCastToFp8")));
    prog.add(poplar::program::Execute(castFrom, debugContext("groupCastFromFp8")));

    return {inTensorOrder(values, byStart).reshape(x.shape()), scales.reshape(scaleDims),
            flags.reshape(scaleDims)};
  }
};

class Fp8GroupQuantiseOpx : public GroupCastOpx {
 public:
  Fp8GroupQuantiseOpx(popart::Op* op, popart::popx::Devicex* devicex)
      : GroupCastOpx(op, devicex) {
    verifyOp<Fp8GroupQuantiseOp>(op, kFp8GroupQuantise);
  }

  void grow(poplar::program::Sequence& prog) const final {
    const GroupCastTensors cast =
        growGroupCast(prog, getInTensor(0), getOp<Fp8GroupQuantiseOp>().attributes());
    setOutTensor(0, cast.values);
    setOutTensor(1, cast.log2Scales);
    setOutTensor(2, cast.nonFinite);
  }
};

// Fp8GroupGradientQuantiseGrad: the gradient cast as Fp8GroupQuantise casts.
class Fp8GroupGradientQuantiseGradOpx : public GroupCastOpx {
 public:
  Fp8GroupGradientQuantiseGradOpx(popart::Op* op, popart::popx::Devicex* devicex)
      : GroupCastOpx(op, devicex) {
    verifyOp<GroupGradOp>(op, kFp8GroupGradientQuantiseGrad);
  }

  void grow(poplar::program::Sequence& prog) const final {
    setOutTensor(0, growGroupCast(prog, getInTensor(0), getOp<GroupGradOp>().attributes())
                        .values);
  }
};

// Fp8GroupQuantiseGrad and Fp8GroupGradientQuantise: the identity, as a copy
// so the output never aliases.
class GroupIdentityOpx : public popart::popx::Opx {
 public:
  GroupIdentityOpx(popart::Op* op, popart::popx::Devicex* devicex)
      : popart::popx::Opx(op, devicex) {
    verifyOp<GroupCastOp>(op, {kFp8GroupQuantiseGrad, kFp8GroupGradientQuantise});
  }
  void grow(poplar::program::Sequence& prog) const final {
    setOutTensor(0, cloneNcopy(prog, getInTensor(0)));
  }
};

namespace {
popart::popx::OpxCreator<Fp8GroupQuantiseOpx> fp8GroupQuantiseOpxCreator(kFp8GroupQuantise);
popart::popx::OpxCreator<Fp8GroupGradientQuantiseGradOpx> fp8GroupGradientQuantiseGradOpxCreator(
    kFp8GroupGradientQuantiseGrad);
popart::popx::OpxCreator<GroupIdentityOpx> groupIdentityOpxCreator(
    {kFp8GroupQuantiseGrad, kFp8GroupGradientQuantise});
}  // namespace

}  // namespace ius_custom_ops
