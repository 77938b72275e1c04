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
// host to check. Poplar's QuarterMetadata scale is -s. No grad op: the codes
// are not differentiable; Fp8Quantise (fp8_quantise.cpp) is the op to train with.
#include <memory>

#include <popart/error.hpp>
#include <popart/op.hpp>
#include <popart/opmanager.hpp>
#include <popart/popx/opxmanager.hpp>
#include <popart/shapeinference.hpp>

#include "fp8_ops.hpp"

namespace ius_custom_ops {

class Fp8AmaxCastOp : public popart::Op {
 public:
  Fp8AmaxCastOp(const popart::OperatorIdentifier& opid, const Fp8Attributes& attributes,
                const popart::Op::Settings& settings)
      : popart::Op(opid, settings), attributes_(attributes) {}

  void setup() override {
    attributes_.validate("Fp8AmaxCast");
    outInfo(0) = popart::TensorInfo(popart::DataType::UINT8, inInfo(0).shape());
    outInfo(1) = popart::TensorInfo(popart::DataType::INT32, popart::Shape{});
    outInfo(2) = popart::TensorInfo(popart::DataType::INT32, popart::Shape{});
  }

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8AmaxCastOp>(*this);
  }

  float getSubgraphValue() const final { return getLowSubgraphValue(); }

  void appendOutlineAttributes(popart::OpSerialiserBase& os) const override {
    popart::Op::appendOutlineAttributes(os);
    attributes_.appendTo(os);
  }

  const Fp8Attributes& attributes() const { return attributes_; }

 private:
  Fp8Attributes attributes_;
};

namespace {

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
    [](const popart::OpCreatorInfo& info) -> std::unique_ptr<popart::Op> {
      return std::make_unique<Fp8AmaxCastOp>(
          info.opid, Fp8Attributes::read(info.attributes, "F143", 0), info.settings);
    },
    true);

popart::RegisterShapeInferenceFunction fp8AmaxCastShapeInference(
    kFp8AmaxCast, [](popart::ShapeInferenceContext& ctx) {
      ctx.outInfo(0) = {popart::DataType::UINT8, ctx.inShape(0)};
      ctx.outInfo(1) = {popart::DataType::INT32, popart::Shape{}};
      ctx.outInfo(2) = {popart::DataType::INT32, popart::Shape{}};
    });

}  // namespace

class Fp8AmaxCastOpx : public CodeletOpx {
 public:
  Fp8AmaxCastOpx(popart::Op* op, popart::popx::Devicex* devicex) : CodeletOpx(op, devicex) {
    verifyOp<Fp8AmaxCastOp>(op, kFp8AmaxCast);
  }

  void grow(poplar::program::Sequence& prog) const final {
    const Fp8Attributes& attributes = getOp<Fp8AmaxCastOp>().attributes();
    const poplar::Tensor input = getInTensor(0);
    const poplar::Tensor flat = input.flatten();
    const Scale scale = growScale(prog, flat, attributes);
    const poplar::Tensor codes = growCastToFp8(prog, flat, scale.log2Scale, attributes);
    setOutTensor(0, codes.reshape(input.shape()));
    setOutTensor(1, scale.log2Scale);
    setOutTensor(2, scale.nonFinite);
  }
};

namespace {
popart::popx::OpxCreator<Fp8AmaxCastOpx> fp8AmaxCastOpxCreator(kFp8AmaxCast);
}  // namespace

}  // namespace ius_custom_ops
