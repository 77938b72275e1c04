// Shared parts of the FP8 PopART custom ops (domain "ai.graphcore.unit_scaling",
// version 1): their identifiers, their attributes, and the Opx base class that
// grows the Poplar graph around the codelets (codelets/fp8_codelets.cpp).
//
//   Fp8AmaxCast          x -> codes, log2_scale, non_finite     (fp8_amax_cast.cpp)
//   Fp8Quantise          x -> decode(cast(x * 2^s)) * 2^-s       (fp8_quantise.cpp)
//                          grad op: dx = dy (straight through)
//   Fp8GradientQuantise  x -> x
//                          grad op: dx = decode(cast(dy * 2^s)) * 2^-s, s from amax(dy)
//                          or the given log2_scale
//   Fp8GroupQuantise     x -> decode(cast(x * 2^s)) * 2^-s with s per group (rowwise,
//                          block, MX), log2_scales, non_finite    (fp8_group_quantise.cpp)
//                          grad op: dx = dy
//   Fp8GroupGradientQuantise  x -> x                              (fp8_group_quantise.cpp)
//                          grad op: dx = dy cast as Fp8GroupQuantise casts x
//
// Scaling-bias convention, as everywhere in the project: q = cast(x * 2^s),
// s = clamp(floor(log2(max / amax)) - margin, -31, 31), s = 0 for amax 0.
// Poplar's QuarterMetadata scale is -s.
#pragma once

#include <cstdint>
#include <string>

#include <poplar/Graph.hpp>
#include <poplar/Program.hpp>
#include <popart/attributes.hpp>
#include <popart/names.hpp>
#include <popart/operatoridentifier.hpp>
#include <popart/opserialiser.hpp>
#include <popart/popx/inputcreatortype.hpp>
#include <popart/popx/opx.hpp>
#include <popart/region.hpp>

namespace ius_custom_ops {

constexpr const char* kDomain = "ai.graphcore.unit_scaling";

const popart::OperatorIdentifier kFp8AmaxCast = {kDomain, "Fp8AmaxCast", 1, 1, 3};
const popart::OperatorIdentifier kFp8Quantise = {kDomain, "Fp8Quantise", 1, 1, 1};
const popart::OperatorIdentifier kFp8QuantiseGrad = {kDomain, "Fp8QuantiseGrad", 1, 1, 1};
const popart::OperatorIdentifier kFp8GradientQuantise = {kDomain, "Fp8GradientQuantise", 1, 1,
                                                         1};
const popart::OperatorIdentifier kFp8GradientQuantiseGrad = {kDomain, "Fp8GradientQuantiseGrad",
                                                             1, 1, 1};

// The attributes every FP8 op takes: format "F143" | "F152", margin (0..31),
// saturate (0 | 1), has_log2_scale (0 | 1) and log2_scale (-31..31), the scale
// to use instead of the amax's when has_log2_scale is 1.
struct Fp8Attributes {
  std::string format = "F143";
  int64_t margin = 0;
  bool saturate = true;
  bool hasLog2Scale = false;
  int64_t log2Scale = 0;

  // Missing attributes take the defaults given: Fp8GradientQuantise's are the
  // gradient format's (F152, margin 3), the other ops' F143, margin 0.
  static Fp8Attributes read(const popart::Attributes& attributes,
                            const std::string& defaultFormat, int64_t defaultMargin);

  // Throws popart::error naming the op for a format other than F143/F152, a
  // margin outside 0..31 or a given scale outside -31..31.
  void validate(const std::string& opName) const;

  // For outlining and serialisation: ops with different attributes must
  // never be merged into one subgraph.
  void appendTo(popart::OpSerialiserBase& os) const;

  // The codelets' template argument: 4 for F143, 5 for F152.
  unsigned exponentBits() const { return format == "F152" ? 5u : 4u; }
};

// Adds the codelets (codelets/fp8_codelets.cpp and fp8_block_codelets.cpp) to
// the graph, once.
void addFp8Codelets(poplar::Graph& graph);

// An Opx that builds its program from the FP8 codelets (fp8_graph.cpp). Its
// vertices follow the input's tile mapping, and its outputs take the input's
// layout, so nothing is exchanged but the amax partials (in a tree,
// ius::planAmaxTree of codelets/placement.hpp) and the scale. The emulator and
// the graph model in ipu_unit_scaling/emulator.py use the same plan.
class CodeletOpx : public popart::popx::Opx {
 public:
  CodeletOpx(popart::Op* op, popart::popx::Devicex* devicex) : popart::popx::Opx(op, devicex) {}

  // Input 0 is laid out by the op that consumes output 0 (a matmul, say),
  // unwound through this op: CanUnwind, as poplibs-backed element-wise Opxs do.
  popart::popx::InputCreatorType getInputCreatorType(popart::InIndex index) const override;
  bool canUnwind(popart::InIndex in, popart::OutIndex out) const override;
  poplar::Tensor unwindTensorLayout(poplar::Tensor tensor, popart::InIndex in,
                                    popart::OutIndex out) const override;
  popart::view::RegMap unwindRegion(popart::InIndex in, popart::OutIndex out) const override;

 protected:
  struct Scale {
    poplar::Tensor log2Scale;  // int32 scalar on the amax tree's root tile
    poplar::Tensor nonFinite;  // int32 scalar there: 1 when the amax was inf/NaN
  };

  // The given scale as a constant, or PartialAmax on every tile holding input,
  // MaxPartials up the tree and ScalingBias at its root. A non-finite amax
  // gives s = 0 and nonFinite = 1: a vertex cannot raise.
  Scale growScale(poplar::program::Sequence& prog, const poplar::Tensor& flat,
                  const Fp8Attributes& attributes) const;

  // CastToFp8 on every tile holding input: uint8 codes laid out like flat.
  poplar::Tensor growCastToFp8(poplar::program::Sequence& prog, const poplar::Tensor& flat,
                               const poplar::Tensor& log2Scale,
                               const Fp8Attributes& attributes) const;

  // CastFromFp8 on every tile holding codes: decode(codes) * 2^-s as `type`,
  // laid out like the codes.
  poplar::Tensor growCastFromFp8(poplar::program::Sequence& prog, const poplar::Tensor& codes,
                                 const poplar::Tensor& log2Scale, const poplar::Type& type,
                                 const Fp8Attributes& attributes) const;

  // decode(cast(x * 2^s)) * 2^-s in x's type and shape: the whole quantise.
  poplar::Tensor growQuantise(poplar::program::Sequence& prog, const poplar::Tensor& x,
                              const Fp8Attributes& attributes) const;
};

}  // namespace ius_custom_ops
