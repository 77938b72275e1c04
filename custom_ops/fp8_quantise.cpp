// PopART custom ops for FP8 training, each with its grad op, so that PopART's
// autodiff (which is what differentiates a PopTorch model) gets the gradients
// of the FP8 casts from the ops themselves.
//
//   y = Fp8Quantise(x)           domain "ai.graphcore.unit_scaling", version 1
//     attributes: format "F143" | "F152", margin (0..31), saturate (0 | 1),
//                 has_log2_scale (0 | 1), log2_scale (-31..31)
//     y = decode(cast(x * 2^s)) * 2^-s in x's type and shape, s from the amax
//     of x by the scaling rule, or the given log2_scale.
//     Fp8QuantiseGrad: dx = dy (straight through).
//
//   y = Fp8GradientQuantise(x)   the same attributes
//     y = x.
//     Fp8GradientQuantiseGrad: dx = decode(cast(dy * 2^s)) * 2^-s with s from
//     the amax of dy, or the given log2_scale: the gradient is quantised as
//     Fp8Quantise quantises its input.
//
// A non-finite amax gives s = 0 and the cast goes on (NaN stays NaN, inf
// follows the overflow policy), so the NaN reaches the loss and the training
// loop's NaN check reports it; a vertex cannot raise.
#include <map>
#include <memory>
#include <vector>

#include <popart/op.hpp>
#include <popart/opmanager.hpp>
#include <popart/popx/opxmanager.hpp>
#include <popart/region.hpp>
#include <popart/shapeinference.hpp>

#include "fp8_ops.hpp"

namespace ius_custom_ops {

namespace {

// Both grad ops read only the gradient of output 0 and give the gradient of
// input 0.
const std::vector<popart::GradInOutMapper>& gradOfOutputZero() {
  static const std::vector<popart::GradInOutMapper> info = {
      {0, 0, popart::GradOpInType::GradOut}};
  return info;
}

const std::map<int, int>& toInputZero() {
  static const std::map<int, int> info = {{0, 0}};
  return info;
}

}  // namespace

// An op with the FP8 attributes whose output has its input's type and shape.
class Fp8UnaryOp : public popart::Op {
 public:
  Fp8UnaryOp(const popart::OperatorIdentifier& opid, const Fp8Attributes& attributes,
             const popart::Op::Settings& settings)
      : popart::Op(opid, settings), attributes_(attributes) {}

  void setup() override {
    attributes_.validate(opid.type);
    outInfo(0) = inInfo(0);
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

class Fp8QuantiseGradOp : public Fp8UnaryOp {
 public:
  explicit Fp8QuantiseGradOp(const Fp8UnaryOp& forward)
      : Fp8UnaryOp(kFp8QuantiseGrad, forward.attributes(), forward.settings) {}

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8QuantiseGradOp>(*this);
  }
  const std::vector<popart::GradInOutMapper>& gradInputInfo() const final {
    return gradOfOutputZero();
  }
  const std::map<int, int>& gradOutToNonGradIn() const final { return toInputZero(); }
};

class Fp8QuantiseOp : public Fp8UnaryOp {
 public:
  using Fp8UnaryOp::Fp8UnaryOp;

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8QuantiseOp>(*this);
  }
  std::vector<std::unique_ptr<popart::Op>> getGradOps() final {
    std::vector<std::unique_ptr<popart::Op>> gradOps;
    gradOps.push_back(std::make_unique<Fp8QuantiseGradOp>(*this));
    return gradOps;
  }
};

class Fp8GradientQuantiseGradOp : public Fp8UnaryOp {
 public:
  explicit Fp8GradientQuantiseGradOp(const Fp8UnaryOp& forward)
      : Fp8UnaryOp(kFp8GradientQuantiseGrad, forward.attributes(), forward.settings) {}

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8GradientQuantiseGradOp>(*this);
  }
  const std::vector<popart::GradInOutMapper>& gradInputInfo() const final {
    return gradOfOutputZero();
  }
  const std::map<int, int>& gradOutToNonGradIn() const final { return toInputZero(); }
};

class Fp8GradientQuantiseOp : public Fp8UnaryOp {
 public:
  using Fp8UnaryOp::Fp8UnaryOp;

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<Fp8GradientQuantiseOp>(*this);
  }
  std::vector<std::unique_ptr<popart::Op>> getGradOps() final {
    std::vector<std::unique_ptr<popart::Op>> gradOps;
    gradOps.push_back(std::make_unique<Fp8GradientQuantiseGradOp>(*this));
    return gradOps;
  }
};

namespace {

const popart::OpDefinition::DataTypes kFloatTypes = {popart::DataType::FLOAT,
                                                     popart::DataType::FLOAT16};

popart::OpCreator<Fp8QuantiseOp> fp8QuantiseOpCreator(
    popart::OpDefinitions({{kFp8Quantise,
                            {popart::OpDefinition::Inputs({{"x", kFloatTypes}}),
                             popart::OpDefinition::Outputs({{"y", kFloatTypes}}),
                             popart::OpDefinition::Attributes({{"format", {"*"}},
                                                               {"margin", {"*"}},
                                                               {"saturate", {"*"}},
                                                               {"has_log2_scale", {"*"}},
                                                               {"log2_scale", {"*"}}})}}}),
    [](const popart::OpCreatorInfo& info) -> std::unique_ptr<popart::Op> {
      return std::make_unique<Fp8QuantiseOp>(
          info.opid, Fp8Attributes::read(info.attributes, "F143", 0), info.settings);
    },
    true);

// Defaults are FP8Config's for gradients: F152 with a margin of 3.
popart::OpCreator<Fp8GradientQuantiseOp> fp8GradientQuantiseOpCreator(
    popart::OpDefinitions({{kFp8GradientQuantise,
                            {popart::OpDefinition::Inputs({{"x", kFloatTypes}}),
                             popart::OpDefinition::Outputs({{"y", kFloatTypes}}),
                             popart::OpDefinition::Attributes({{"format", {"*"}},
                                                               {"margin", {"*"}},
                                                               {"saturate", {"*"}},
                                                               {"has_log2_scale", {"*"}},
                                                               {"log2_scale", {"*"}}})}}}),
    [](const popart::OpCreatorInfo& info) -> std::unique_ptr<popart::Op> {
      return std::make_unique<Fp8GradientQuantiseOp>(
          info.opid, Fp8Attributes::read(info.attributes, "F152", 3), info.settings);
    },
    true);

void sameTypeAndShape(popart::ShapeInferenceContext& ctx) {
  ctx.outInfo(0) = {ctx.inType(0), ctx.inShape(0)};
}

popart::RegisterShapeInferenceFunction fp8QuantiseShapeInference(kFp8Quantise,
                                                                 sameTypeAndShape);
popart::RegisterShapeInferenceFunction fp8GradientQuantiseShapeInference(kFp8GradientQuantise,
                                                                         sameTypeAndShape);

}  // namespace

// Fp8Quantise and Fp8GradientQuantiseGrad: the codelets' quantise.
class QuantiseOpx : public CodeletOpx {
 public:
  QuantiseOpx(popart::Op* op, popart::popx::Devicex* devicex) : CodeletOpx(op, devicex) {
    verifyOp<Fp8UnaryOp>(op, {kFp8Quantise, kFp8GradientQuantiseGrad});
  }

  void grow(poplar::program::Sequence& prog) const final {
    const Fp8Attributes& attributes = getOp<Fp8UnaryOp>().attributes();
    setOutTensor(0, growQuantise(prog, getInTensor(0), attributes));
  }
};

// Fp8QuantiseGrad and Fp8GradientQuantise: the identity, as a copy so the
// output never aliases the input. The copy keeps the layout, so the input may
// take the layout of whatever consumes the output.
class IdentityCopyOpx : public popart::popx::Opx {
 public:
  IdentityCopyOpx(popart::Op* op, popart::popx::Devicex* devicex)
      : popart::popx::Opx(op, devicex) {
    verifyOp<Fp8UnaryOp>(op, {kFp8QuantiseGrad, kFp8GradientQuantise});
  }

  popart::popx::InputCreatorType getInputCreatorType(popart::InIndex) const final {
    return popart::popx::InputCreatorType::CanUnwind;
  }
  poplar::Tensor unwindTensorLayout(poplar::Tensor tensor, popart::InIndex,
                                    popart::OutIndex) const final {
    return tensor;
  }
  popart::view::RegMap unwindRegion(popart::InIndex, popart::OutIndex) const final {
    return [](const popart::view::Region& region) { return popart::view::Regions(1, region); };
  }

  void grow(poplar::program::Sequence& prog) const final {
    setOutTensor(0, cloneNcopy(prog, getInTensor(0)));
  }
};

namespace {
popart::popx::OpxCreator<QuantiseOpx> quantiseOpxCreator({kFp8Quantise,
                                                          kFp8GradientQuantiseGrad});
popart::popx::OpxCreator<IdentityCopyOpx> identityCopyOpxCreator({kFp8QuantiseGrad,
                                                                  kFp8GradientQuantise});
}  // namespace

}  // namespace ius_custom_ops
