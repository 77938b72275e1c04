// cppimport
// (That first line lets cppimport build this file: PopXL's custom-op guide's way.)
//
// PopXL custom op: the codelets' tile-local FP8 amax, scaling bias and cast, with the
// codes typed as a PopXL float8 tensor, so that ops.matmul_pow2scaled takes them.
//
//   codes, log2_scale, non_finite = Fp8AmaxCastFloat8(x)
//     domain "ai.graphcore.unit_scaling", version 1
//     params: format "F143" | "F152", margin (0..31), saturate
//
// The graph is Fp8AmaxCast's (fp8_amax_cast.cpp, built by CodeletOpx in fp8_graph.cpp):
// PartialAmax on every tile holding input, the amax tree up to ScalingBias, CastToFp8 on
// every tile holding input. Only the type of output 0 differs: FLOAT8_143 / FLOAT8_152
// instead of UINT8. PopART keeps float8 tensors as unsigned char in Poplar and reinterprets
// them, with the scale it is given, in every float8 op (Pow2ScaleThenCastOpx does the same),
// so the codelets' codes are such a tensor as they are. q = cast(x * 2^s), the sign of
// pow2scale_cast_to_fp8 and of the whole project.
//
// A Python extension module for PopXL (pybind11, PopXL's ParameterizedOp bindings), built
// and loaded by ipu_unit_scaling/popxl/codelets.py with cppimport, as PopXL's custom-op
// examples are: cppimport reads the build settings at the end of this file. The module must
// use the pybind11 release popart._internal.ir was built with (the SDK's PopXL guide pins
// pybind11 2.6.2): its types are passed to makeParameterizedOpBindings' functions, and a
// module built with another release would not recognise them. No grad op: PopXL models
// write the backward of FP8 layers by hand.
#include <cstdint>
#include <memory>
#include <string>

#include <pybind11/pybind11.h>
#include <popart/op.hpp>
#include <popart/op/custom/parameterizedop.hpp>
#include <popart/op/custom/parameterizedopbinder.hpp>
#include <popart/popx/opxmanager.hpp>
#include <popart/tensorinfo.hpp>

#include "fp8_ops.hpp"

namespace ius_custom_ops {

const popart::OperatorIdentifier kFp8AmaxCastFloat8 = {kDomain, "Fp8AmaxCastFloat8", 1, 1, 3};

// ParameterizedOp wants its attributes in one struct that serialises itself.
struct Fp8AmaxCastParams {
  Fp8Attributes attributes;

  void appendAttributes(popart::OpSerialiserBase& os) const { attributes.appendTo(os); }

  static Fp8AmaxCastParams makeFromAttributes(const popart::Attributes& attributes) {
    return Fp8AmaxCastParams{Fp8Attributes::read(attributes, "F143", 0)};
  }
};

class Fp8AmaxCastFloat8Op
    : public popart::ParameterizedOp<Fp8AmaxCastFloat8Op, Fp8AmaxCastParams> {
 public:
  using popart::ParameterizedOp<Fp8AmaxCastFloat8Op, Fp8AmaxCastParams>::ParameterizedOp;

  static popart::OperatorIdentifier defaultOperatorId() { return kFp8AmaxCastFloat8; }

  void setup() override {
    const Fp8Attributes& attributes = params().attributes;
    attributes.validate("Fp8AmaxCastFloat8");
    const popart::DataType codes = attributes.format == "F152" ? popart::DataType::FLOAT8_152
                                                               : popart::DataType::FLOAT8_143;
    outInfo(0) = popart::TensorInfo(codes, inInfo(0).shape());
    outInfo(1) = popart::TensorInfo(popart::DataType::INT32, popart::Shape{});
    outInfo(2) = popart::TensorInfo(popart::DataType::INT32, popart::Shape{});
  }

  float getSubgraphValue() const final { return getLowSubgraphValue(); }
};

class Fp8AmaxCastFloat8Opx : public CodeletOpx {
 public:
  Fp8AmaxCastFloat8Opx(popart::Op* op, popart::popx::Devicex* devicex)
      : CodeletOpx(op, devicex) {
    verifyOp<Fp8AmaxCastFloat8Op>(op, kFp8AmaxCastFloat8);
  }

  void grow(poplar::program::Sequence& prog) const final {
    const Fp8Attributes& attributes = getOp<Fp8AmaxCastFloat8Op>().params().attributes;
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
popart::popx::OpxCreator<Fp8AmaxCastFloat8Opx> fp8AmaxCastFloat8OpxCreator(kFp8AmaxCastFloat8);
}  // namespace

}  // namespace ius_custom_ops

PYBIND11_MODULE(ius_popxl_ops, m) {
  namespace py = pybind11;
  using ius_custom_ops::Fp8AmaxCastParams;
  py::class_<Fp8AmaxCastParams>(m, "Fp8AmaxCastParams")
      .def(py::init([](const std::string& format, int64_t margin, bool saturate) {
             Fp8AmaxCastParams params;
             params.attributes.format = format;
             params.attributes.margin = margin;
             params.attributes.saturate = saturate;
             return params;
           }),
           py::arg("format"), py::arg("margin"), py::arg("saturate"));
  popart::ir::op::makeParameterizedOpBindings<ius_custom_ops::Fp8AmaxCastFloat8Op>(
      m, "Fp8AmaxCastFloat8");
}

// cppimport build settings (Mako, run by cppimport before compiling). The codelets are
// compiled by Poplar from source when the graph first needs them, for the device's own
// target; IPU_UNIT_SCALING_CODELETS may name a popc-built .gp instead.
/*
<%
import os
codelets = os.path.realpath(os.path.join(os.path.dirname(filepath), '..', 'codelets'))
cfg['sources'] = ['fp8_graph.cpp']
cfg['include_dirs'] = [codelets]
cfg['dependencies'] = ['fp8_ops.hpp', 'fp8_graph.cpp', os.path.join(codelets, 'placement.hpp'),
                       os.path.join(codelets, 'partition.hpp')]
cfg['extra_compile_args'] = ['-std=c++17', '-fPIC', '-O3', '-DONNX_NAMESPACE=onnx',
                             '-DIUS_CODELETS_DIR="%s"' % codelets]
cfg['libraries'] = ['popart', 'poplar', 'poputil']
setup_pybind11(cfg)
%>
*/
