// PopART custom op: a unit-scaling scale as one op, whose gradient is scaled
// by a factor of its own.
//
//   y = ScaledIdentity(x)        domain "ai.graphcore.unit_scaling", version 1
//     attributes: fwd_scale (float), bwd_scale (float), both required
//     y = fwd_scale * x, in x's type and shape.
//     ScaledIdentityGrad: dx = bwd_scale * dy.
//
// Element-wise: each output element depends on the input element at the same
// index, so the output takes the input's layout and the input may take the
// layout of whatever consumes the output. Both ops have an in-place variant,
// ScaledIdentityInplace (y aliases and overwrites x), which PopART's inplacing
// pass picks where x is not needed afterwards. Neither forward op is ever
// replaced by the identity: with fwd_scale 1 the value passes unchanged but
// the gradient is still scaled. The grad op with bwd_scale 1 is the identity.
//
// For float16 the product is computed in float32 and rounded once to float16,
// as torch's CPU kernel computes `x * scale`, so the IPU op and the
// torch.library op (ipu_unit_scaling/scaled_identity.py) give the same values.
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <poplar/Graph.hpp>
#include <poplar/Program.hpp>
#include <poplar/Tensor.hpp>
#include <poplar/Type.hpp>
#include <popops/ElementWise.hpp>
#include <popops/Expr.hpp>
#include <popart/attributes.hpp>
#include <popart/error.hpp>
#include <popart/names.hpp>
#include <popart/op.hpp>
#include <popart/op/elementwise.hpp>
#include <popart/operatoridentifier.hpp>
#include <popart/opmanager.hpp>
#include <popart/opserialiser.hpp>
#include <popart/popx/op/elementwisex.hpp>
#include <popart/popx/opxmanager.hpp>
#include <popart/shapeinference.hpp>

#include "fp8_ops.hpp"

namespace ius_custom_ops {

const popart::OperatorIdentifier kScaledIdentity = {kDomain, "ScaledIdentity", 1, 1, 1};
const popart::OperatorIdentifier kScaledIdentityGrad = {kDomain, "ScaledIdentityGrad", 1, 1, 1};
const popart::OperatorIdentifier kScaledIdentityInplace = {kDomain, "ScaledIdentityInplace", 1,
                                                           1, 1};

namespace {

// The in-place variant is preferred whenever PopART can alias x, as for
// its own element-wise ops.
constexpr float kInplacePriority = 10.0f;

}  // namespace

// y = factor * x, overwriting x: the in-place form of both ops below. It is
// made by the inplacing pass after autodiff, so it needs no grad op.
class ScaledIdentityInplaceOp : public popart::ElementWiseInplaceUnaryOp {
 public:
  ScaledIdentityInplaceOp(float factor, const popart::Op::Settings& settings)
      : popart::ElementWiseInplaceUnaryOp(kScaledIdentityInplace, settings), factor_(factor) {}

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<ScaledIdentityInplaceOp>(*this);
  }

  void appendOutlineAttributes(popart::OpSerialiserBase& os) const final {
    popart::Op::appendOutlineAttributes(os);
    os.appendAttribute("factor", factor_);
  }

  float factor() const { return factor_; }

 private:
  float factor_;
};

// The grad op: dx = bwd_scale * dy.
class ScaledIdentityGradOp : public popart::ElementWiseUnaryOp {
 public:
  ScaledIdentityGradOp(float bwdScale, const popart::Op::Settings& settings)
      : popart::ElementWiseUnaryOp(kScaledIdentityGrad, settings), factor_(bwdScale) {}

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<ScaledIdentityGradOp>(*this);
  }

  const std::vector<popart::GradInOutMapper>& gradInputInfo() const final {
    static const std::vector<popart::GradInOutMapper> info = {
        {getInIndex(), getOutIndex(), popart::GradOpInType::GradOut}};
    return info;
  }

  const std::map<int, int>& gradOutToNonGradIn() const final {
    static const std::map<int, int> info = {{getOutIndex(), getInIndex()}};
    return info;
  }

  bool canBeReplacedByIdentity() const final { return factor_ == 1.0f; }

  std::vector<std::tuple<popart::OperatorIdentifier, float>> inplacePriorityDefault()
      const final {
    return {{kScaledIdentityInplace, kInplacePriority}};
  }

  std::unique_ptr<popart::Op> getInplaceVariant(
      const popart::OperatorIdentifier& id) const final {
    if (id == kScaledIdentityInplace) {
      return std::make_unique<ScaledIdentityInplaceOp>(factor_, getSettings());
    }
    return popart::Op::getInplaceVariant(id);
  }

  void appendOutlineAttributes(popart::OpSerialiserBase& os) const final {
    popart::Op::appendOutlineAttributes(os);
    os.appendAttribute("factor", factor_);
  }

  float factor() const { return factor_; }

 private:
  float factor_;
};

// y = fwd_scale * x; its grad op scales by bwd_scale.
class ScaledIdentityOp : public popart::ElementWiseUnaryOp {
 public:
  ScaledIdentityOp(const popart::OperatorIdentifier& opid, float fwdScale, float bwdScale,
                   const popart::Op::Settings& settings)
      : popart::ElementWiseUnaryOp(opid, settings), fwdScale_(fwdScale), bwdScale_(bwdScale) {}

  std::unique_ptr<popart::Op> clone() const final {
    return std::make_unique<ScaledIdentityOp>(*this);
  }

  std::vector<std::unique_ptr<popart::Op>> getGradOps() final {
    std::vector<std::unique_ptr<popart::Op>> gradOps;
    gradOps.push_back(std::make_unique<ScaledIdentityGradOp>(bwdScale_, getSettings()));
    return gradOps;
  }

  // Not canBeReplacedByIdentity even when fwd_scale is 1: the grad op must stay.

  std::vector<std::tuple<popart::OperatorIdentifier, float>> inplacePriorityDefault()
      const final {
    return {{kScaledIdentityInplace, kInplacePriority}};
  }

  std::unique_ptr<popart::Op> getInplaceVariant(
      const popart::OperatorIdentifier& id) const final {
    if (id == kScaledIdentityInplace) {
      return std::make_unique<ScaledIdentityInplaceOp>(fwdScale_, getSettings());
    }
    return popart::Op::getInplaceVariant(id);
  }

  // Ops with different scales must never be outlined into one subgraph.
  void appendOutlineAttributes(popart::OpSerialiserBase& os) const final {
    popart::Op::appendOutlineAttributes(os);
    os.appendAttribute("fwd_scale", fwdScale_);
    os.appendAttribute("bwd_scale", bwdScale_);
  }

  float fwdScale() const { return fwdScale_; }

 private:
  float fwdScale_;
  float bwdScale_;
};

namespace {

float requiredScale(const popart::Attributes& attributes, const std::string& name) {
  if (!attributes.hasAttribute(name)) {
    throw popart::error("ScaledIdentity: the float attribute {} is missing", name);
  }
  return attributes.getAttribute<popart::Attributes::Float>(name, 1.0f);
}

const popart::OpDefinition::DataTypes kFloatTypes = {popart::DataType::FLOAT,
                                                     popart::DataType::FLOAT16};

popart::OpCreator<ScaledIdentityOp> scaledIdentityOpCreator(
    popart::OpDefinitions({{kScaledIdentity,
                            {popart::OpDefinition::Inputs({{"x", kFloatTypes}}),
                             popart::OpDefinition::Outputs({{"y", kFloatTypes}}),
                             popart::OpDefinition::Attributes({{"fwd_scale", {"*"}},
                                                               {"bwd_scale", {"*"}}})}}}),
    [](const popart::OpCreatorInfo& info) -> std::unique_ptr<popart::Op> {
      return std::make_unique<ScaledIdentityOp>(info.opid,
                                                requiredScale(info.attributes, "fwd_scale"),
                                                requiredScale(info.attributes, "bwd_scale"),
                                                info.settings);
    },
    true);

popart::RegisterShapeInferenceFunction scaledIdentityShapeInference(
    kScaledIdentity, [](popart::ShapeInferenceContext& ctx) {
      ctx.outInfo(0) = {ctx.inType(0), ctx.inShape(0)};
    });

// The factor of any of the three ops.
float factorOf(const popart::Op* op) {
  if (const auto* forward = dynamic_cast<const ScaledIdentityOp*>(op)) {
    return forward->fwdScale();
  }
  if (const auto* grad = dynamic_cast<const ScaledIdentityGradOp*>(op)) {
    return grad->factor();
  }
  if (const auto* inplace = dynamic_cast<const ScaledIdentityInplaceOp*>(op)) {
    return inplace->factor();
  }
  throw popart::error("ScaledIdentity: {} is not a ScaledIdentity op", op->str());
}

}  // namespace

// factor * x as one popops map: float32 directly; float16 through float32,
// rounded once at the end.
class ScaledIdentityComputex : public popart::popx::EwuComputex {
 public:
  explicit ScaledIdentityComputex(float factor) : factor_(factor) {}

  poplar::Tensor outplace(poplar::program::Sequence& prog, poplar::Graph& graph,
                          const poplar::Tensor& tensor, const poplar::DebugNameAndId& dnai,
                          const std::string& name) const final {
    return popops::map(graph, *expression(tensor.elementType()), {tensor}, prog, {dnai, name});
  }

  void inplace(poplar::program::Sequence& prog, poplar::Graph& graph,
               const poplar::Tensor& tensor, const poplar::DebugNameAndId& dnai,
               const std::string& name) const final {
    popops::mapInPlace(graph, *expression(tensor.elementType()), {tensor}, prog, {dnai, name});
  }

 private:
  std::unique_ptr<popops::expr::Expr> expression(const poplar::Type& type) const {
    namespace pe = popops::expr;
    if (type == poplar::HALF) {
      return pe::Cast(pe::Mul(pe::Cast(pe::_1, poplar::FLOAT), pe::Const(factor_)), poplar::HALF)
          .clone();
    }
    return pe::Mul(pe::_1, pe::Const(factor_)).clone();
  }

  float factor_;
};

class ScaledIdentityOpx : public popart::popx::ElementWiseUnaryOutplaceOpx {
 public:
  ScaledIdentityOpx(popart::Op* op, popart::popx::Devicex* devicex)
      : popart::popx::ElementWiseUnaryOutplaceOpx(
            op, devicex, std::make_unique<ScaledIdentityComputex>(factorOf(op))) {
    verifyOp<popart::Op>(op, {kScaledIdentity, kScaledIdentityGrad});
  }
};

class ScaledIdentityInplaceOpx : public popart::popx::ElementWiseUnaryInplaceOpx {
 public:
  ScaledIdentityInplaceOpx(popart::Op* op, popart::popx::Devicex* devicex)
      : popart::popx::ElementWiseUnaryInplaceOpx(
            op, devicex, std::make_unique<ScaledIdentityComputex>(factorOf(op))) {
    verifyOp<ScaledIdentityInplaceOp>(op, kScaledIdentityInplace);
  }
};

namespace {
popart::popx::OpxCreator<ScaledIdentityOpx> scaledIdentityOpxCreator({kScaledIdentity,
                                                                      kScaledIdentityGrad});
popart::popx::OpxCreator<ScaledIdentityInplaceOpx> scaledIdentityInplaceOpxCreator(
    kScaledIdentityInplace);
}  // namespace

}  // namespace ius_custom_ops
