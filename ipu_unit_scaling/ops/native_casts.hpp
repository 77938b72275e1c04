// The FP8 casts of the C++ nodes of `native_layers.cpp` (its only includer): the host
// library's kernels called through their addresses, the delayed recipe's amax histories, and
// the buffers the casts are written to, kept between steps.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;

// ---- The casts of the linears' GEMM operands to FP8 values (`fused_blocks._NormQKV` and
// `_ProjNormMLP` with quantisers), in the Python Functions' order.
//
// A cast is given as a spec per (linear, role), made by `fp8.linear.ValuesQuantiser`: empty
// for a float linear; else {kind, fallback id, kernel arguments...}. Kind 1 is the host
// library's per-tensor cast (`ius_fused_quantise`), kind 3 its group casts
// (`ius_group_quantise`), kind 2 the same where a pair kernel makes both casts
// (`ius_group_quantise_pair` for tiles, `ius_rowwise_quantise_pair` for whole rows), kind 0
// a cast this file does not make. Anything the kernels refuse (a non-finite amax, an operand
// they do not take) goes to the Python quantiser, which makes the cast or raises the error
// the Python Function would. Kind 4 is the delayed
// recipe's per-tensor cast: its scale from the amax history of its role (a (3, length)
// float32 tensor the nodes hold, see `hold_history`), the operand's amax pushed into that
// history where the spec says so, then `ius_fused_quantise` with that scale. Kind 5 is NVFP4's
// cast (`ius_nvfp4_quantise`), groups given as for kind 3, and kind 6 MX's to FP4 or FP6
// elements (`ius_mx_subbyte_quantise`), the same with the element format's arguments.

using QuantiseFn = int (*)(const float*, int64_t, int, int, int, int, int, int, float*, int*,
                           float*);
using PairFn = int (*)(const float*, int64_t, int64_t, int64_t, int, int, int, float, int, int,
                       int, int, float*, int*, float*, int*);
using GroupFn = int (*)(const float*, int64_t, int64_t, int64_t, int64_t, int, int, int, float,
                        int, int, int, int, float*, int*);
using AmaxFn = int (*)(const void*, int64_t, int, int, float*);
using RowwisePairFn = int (*)(const float*, int64_t, int64_t, int, int, int, float, int, int,
                              int, int, float*, int*, float*, int*);
using Nvfp4Fn = int (*)(const float*, int64_t, int64_t, int64_t, int64_t, float*, float*,
                        float*);
using MxSubbyteFn = int (*)(const float*, int64_t, int64_t, int64_t, int64_t, int, int, float,
                            int, int, float*, int*);
using Spec = std::vector<double>;

struct HostCasts {
  QuantiseFn quantise = nullptr;
  PairFn pair = nullptr;
  GroupFn group = nullptr;
  AmaxFn amax = nullptr;
  RowwisePairFn rowwise_pair = nullptr;
  Nvfp4Fn nvfp4 = nullptr;
  MxSubbyteFn mx_subbyte = nullptr;
  py::object fallback;  // (id, operand, transposed, out) -> (values, values_t or None)
};

// Leaked: destroying a Python object after the interpreter has gone would crash at exit.
HostCasts* host_casts = nullptr;
// The delayed recipe's amax histories, by the index `hold_history` gave (leaked, as above).
std::vector<Tensor>* histories = nullptr;

// `scaling.log2_scale` of a finite amax >= 0: clamp(floor(log2(format_max / amax)) - margin,
// -31, 31) from the binary exponents, 0 for a zero amax.
int log2_scale(double amax, double format_max, int margin) {
  if (amax == 0.0) return 0;
  int max_exponent = 0, amax_exponent = 0;
  double max_mantissa = std::frexp(format_max, &max_exponent);
  double amax_mantissa = std::frexp(amax, &amax_exponent);
  int exponent = max_exponent - amax_exponent - (amax_mantissa > max_mantissa ? 1 : 0);
  return std::max(-31, std::min(31, exponent - margin));
}

// The delayed cast (kind 4: {4, fallback, exponent bits, saturate, margin, format max,
// reduce by max, update, history, role}) of the contiguous float32 `in` into `out`: false,
// nothing pushed, where the operand's amax is not finite (the Python quantiser then raises).
bool delayed_cast(const Tensor& in, const Spec& spec, Tensor& out) {
  const Tensor& history = (*histories)[int64_t(spec[8])];
  int64_t length = history.size(1);
  float* row = history.data_ptr<float>() + int64_t(spec[9]) * length;
  float kept = row[0];
  if (spec[6] != 0.0)
    for (int64_t i = 1; i < length; ++i) kept = std::max(kept, row[i]);
  int scale = log2_scale(kept, spec[5], int(spec[4]));
  if (spec[7] != 0.0) {
    float amax = 0.0f;
    if (host_casts->amax(in.data_ptr<float>(), in.numel(), 0, at::get_num_threads(), &amax) != 0 ||
        !std::isfinite(amax))
      return false;
    std::memmove(row + 1, row, sizeof(float) * (length - 1));
    row[0] = amax;
    torch::autograd::impl::bump_version(history);
  }
  int used = 0;
  float amax = 0.0f;
  return host_casts->quantise(in.data_ptr<float>(), in.numel(), int(spec[2]), int(spec[3]), 1,
                              scale, 0, at::get_num_threads(), out.data_ptr<float>(), &used,
                              &amax) == 0;
}

// Buffers kept per thread and slot (one operand of one Function, e.g. "up.input"), up to
// 2^20 elements (4 MiB) each, reused wherever nothing else holds them: a cast that only the
// GEMMs of the call read, and one saved for the backward pass once that pass has let it go
// (one per layer, since every layer's Function uses the same slots). Allocating afresh at
// every step would cost the page faults of memory the allocator returned to the system in
// between.
// A slot keeps buffers of the shape last asked for only, and no more than a step had in
// flight at once (at most kBuffersPerSlot): what the step held at its peak anyway. Larger
// buffers, which would be held for the life of the process, are made afresh.
constexpr int64_t kBufferLimit = int64_t(1) << 20;
constexpr std::size_t kBuffersPerSlot = 64;

bool is_free(const Tensor& buffer) {
  return buffer.use_count() == 1 && buffer.storage().use_count() == 1;
}

std::map<std::string, std::vector<Tensor>>& held_buffers() {
  thread_local std::map<std::string, std::vector<Tensor>> held;
  return held;
}

Tensor pooled(const std::string& slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
  std::map<std::string, std::vector<Tensor>>& held = held_buffers();
  if (slot.empty() || c10::multiply_integers(sizes) > kBufferLimit)
    return at::empty(sizes, options);
  std::vector<Tensor>& buffers = held[slot];
  for (const Tensor& buffer : buffers)
    if (buffer.sizes() == sizes && is_free(buffer)) return buffer;
  // (a free buffer of another shape is one the model no longer asks for)
  buffers.erase(std::remove_if(buffers.begin(), buffers.end(),
                               [&](const Tensor& b) { return b.sizes() != sizes && is_free(b); }),
                buffers.end());
  Tensor buffer = at::empty(sizes, options);
  if (buffers.size() < kBuffersPerSlot) buffers.push_back(buffer);
  return buffer;
}

// (the operand of the GEMM that reduces over x's last dimension, that of the one that
// reduces over its first, in x's shape): see `fused_blocks._quantised`.
// One cast by the group kernel: groups of (group_rows, group_cols) of the contiguous 2-D
// `in` (-1: the whole dimension) into a buffer of `slot`; undefined where the kernel refuses.
Tensor group_cast(const Tensor& in, double group_rows, double group_cols, const Spec& spec,
                  const std::string& slot) {
  int64_t rows = in.size(0), cols = in.size(1);
  int64_t gr = group_rows < 0 ? rows : int64_t(group_rows);
  int64_t gc = group_cols < 0 ? cols : int64_t(group_cols);
  Tensor values = pooled(slot, in.sizes(), in.options());
  Tensor scales = pooled(slot.empty() ? slot : slot + "_scales",
                         {((rows + gr - 1) / gr) * ((cols + gc - 1) / gc)},
                         in.options().dtype(at::kInt));
  int status = host_casts->group(in.data_ptr<float>(), rows, cols, gr, gc, int(spec[6]),
                                 int(spec[7]), int(spec[8]), float(spec[9]), int(spec[10]),
                                 int(spec[11]), int(spec[12]), at::get_num_threads(),
                                 values.data_ptr<float>(), scales.data_ptr<int>());
  return status == 0 ? values : Tensor();
}

// One cast to FP4 or FP6 elements (kind 5 or 6) in groups of (group_rows, group_cols) of the
// contiguous 2-D `in` into a buffer of `slot`; undefined where the kernel refuses.
Tensor subbyte_cast(const Tensor& in, double group_rows, double group_cols, const Spec& spec,
                    const std::string& slot) {
  Tensor values = pooled(slot, in.sizes(), in.options());
  int64_t rows = in.size(0), cols = in.size(1), gr = int64_t(group_rows),
          gc = int64_t(group_cols);
  int status = 0;
  if (int(spec[0]) == 5) {
    float tensor_scale = 1.0f;
    status = host_casts->nvfp4(in.data_ptr<float>(), rows, cols, gr, gc,
                               values.data_ptr<float>(), nullptr, &tensor_scale);
  } else {
    Tensor scales = pooled(slot.empty() ? slot : slot + "_scales",
                           {((rows + gr - 1) / gr) * ((cols + gc - 1) / gc)},
                           in.options().dtype(at::kInt));
    status = host_casts->mx_subbyte(in.data_ptr<float>(), rows, cols, gr, gc, int(spec[6]),
                                    int(spec[7]), float(spec[8]), int(spec[9]), int(spec[10]),
                                    values.data_ptr<float>(), scales.data_ptr<int>());
  }
  return status == 0 ? values : Tensor();
}

// (the operand of the GEMM that reduces over x's last dimension, that of the one that
// reduces over its first, in x's shape): see `fused_blocks._quantised`.
// `overwrite`: `x` is a temporary of the caller's that nothing reads after the cast, so a cast
// with a scale known before it reads `x` (the static and delayed recipes') writes its values
// over it, while they are still in the cache, instead of into a kept buffer.
std::pair<Tensor, Tensor> cast_operand(const Tensor& x, const Spec& spec, bool transposed,
                                       const std::string& slot = "", bool overwrite = false) {
  if (spec.empty()) return {x, x};
  TORCH_CHECK(host_casts != nullptr, "the FP8 casts of the C++ layer nodes are not set");
  int kind = int(spec[0]);
  bool takes = x.scalar_type() == at::kFloat && x.device().is_cpu() && x.numel() > 0;
  std::string slot_t = slot.empty() ? slot : slot + "_t";
  if (kind == 4 && takes) {
    Tensor in = x.contiguous();
    // (The operand's amax is read before the values are written.)
    Tensor out = overwrite ? in : pooled(slot, in.sizes(), in.options());
    if (delayed_cast(in, spec, out)) return {out, out};
  } else if (kind == 1 && takes) {
    Tensor in = x.contiguous();
    // (Only with a given scale: the amax form may read its input again after writing.)
    Tensor out = overwrite && spec[4] != 0.0 ? in : pooled(slot, in.sizes(), in.options());
    int used = 0;
    float amax = 0.0f;
    int status = host_casts->quantise(in.data_ptr<float>(), in.numel(), int(spec[2]),
                                      int(spec[3]), int(spec[4]), int(spec[5]), int(spec[6]),
                                      at::get_num_threads(), out.data_ptr<float>(), &used,
                                      &amax);
    if (status == 0) return {out, out};
  } else if (kind == 2 && takes && transposed && x.dim() == 2 && spec[3] < 0) {
    // Whole rows: the rowwise pair kernel (both casts from two reads).
    Tensor in = x.contiguous();
    int64_t rows = in.size(0), cols = in.size(1);
    Tensor row_values = pooled(slot, in.sizes(), in.options());
    Tensor col_values = pooled(slot_t, in.sizes(), in.options());
    Tensor scales = pooled(slot.empty() ? slot : slot + "_scales", {rows + cols},
                           in.options().dtype(at::kInt));
    int* scales_at = scales.data_ptr<int>();
    int status = host_casts->rowwise_pair(
        in.data_ptr<float>(), rows, cols, int(spec[6]), int(spec[7]), int(spec[8]),
        float(spec[9]), int(spec[10]), int(spec[11]), int(spec[12]), at::get_num_threads(),
        row_values.data_ptr<float>(), scales_at, col_values.data_ptr<float>(),
        scales_at + rows);
    if (status == 0) return {row_values, col_values};
  } else if (kind == 2 && takes && transposed && x.dim() == 2) {
    Tensor in = x.contiguous();
    int64_t rows = in.size(0), cols = in.size(1), size = int64_t(spec[3]);
    Tensor row_values = pooled(slot, in.sizes(), in.options());
    Tensor col_values = pooled(slot_t, in.sizes(), in.options());
    int64_t row_scale_count = rows * ((cols + size - 1) / size);
    Tensor scales = pooled(slot.empty() ? slot : slot + "_scales",
                           {row_scale_count + ((rows + size - 1) / size) * cols},
                           in.options().dtype(at::kInt));
    int* scales_at = scales.data_ptr<int>();
    int status = host_casts->pair(in.data_ptr<float>(), rows, cols, size, int(spec[6]),
                                  int(spec[7]), int(spec[8]), float(spec[9]), int(spec[10]),
                                  int(spec[11]), int(spec[12]), at::get_num_threads(),
                                  row_values.data_ptr<float>(), scales_at,
                                  col_values.data_ptr<float>(), scales_at + row_scale_count);
    if (status == 0) return {row_values, col_values};
  } else if ((kind == 5 || kind == 6) && takes && x.dim() == 2) {
    Tensor in = x.contiguous();
    Tensor first = subbyte_cast(in, spec[2], spec[3], spec, slot);
    if (first.defined() && !transposed) return {first, first};
    if (first.defined()) {
      Tensor second = subbyte_cast(in, spec[4], spec[5], spec, slot_t);
      if (second.defined()) return {first, second};
    }
  } else if ((kind == 2 || kind == 3) && takes && x.dim() == 2) {
    Tensor in = x.contiguous();
    Tensor first = group_cast(in, spec[2], spec[3], spec, slot);
    if (first.defined() && (!transposed || spec[4] == 0)) return {first, first};
    if (first.defined()) {
      Tensor second = group_cast(in, spec[4], spec[5], spec, slot_t);
      if (second.defined()) return {first, second};
    }
  }
  py::gil_scoped_acquire gil;
  // (the first cast into a kept buffer, as `fused_blocks._quantised` gives the Python one)
  py::object out = py::none();
  if (!slot.empty() && x.numel() <= kBufferLimit && x.device().is_cpu())
    out = py::cast(pooled(slot, x.sizes(), x.options().dtype(at::kFloat)));
  py::tuple got = host_casts->fallback(int64_t(spec[1]), x, transposed, out);
  Tensor values = got[0].cast<Tensor>();
  Tensor values_t = got[1].is_none() ? values : got[1].cast<Tensor>();
  return {values, values_t};
}

// The buffers the FP8 nodes keep for this thread, by slot: (slot, its buffers' element count).
std::vector<std::pair<std::string, int64_t>> kept_buffers() {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& entry : held_buffers())
    for (const Tensor& buffer : entry.second) out.emplace_back(entry.first, buffer.numel());
  return out;
}

void set_fp8_casts(int64_t quantise, int64_t pair, int64_t group, int64_t amax,
                   int64_t rowwise_pair, int64_t nvfp4, int64_t mx_subbyte,
                   py::object fallback) {
  if (host_casts == nullptr) host_casts = new HostCasts();
  host_casts->quantise = reinterpret_cast<QuantiseFn>(quantise);
  host_casts->pair = reinterpret_cast<PairFn>(pair);
  host_casts->group = reinterpret_cast<GroupFn>(group);
  host_casts->amax = reinterpret_cast<AmaxFn>(amax);
  host_casts->rowwise_pair = reinterpret_cast<RowwisePairFn>(rowwise_pair);
  host_casts->nvfp4 = reinterpret_cast<Nvfp4Fn>(nvfp4);
  host_casts->mx_subbyte = reinterpret_cast<MxSubbyteFn>(mx_subbyte);
  host_casts->fallback = std::move(fallback);
}

// Holds a delayed linear's amax history for kind 4 casts, for the life of the process (a
// few floats each); returns its index.
int64_t hold_history(const Tensor& history) {
  TORCH_CHECK(history.dim() == 2 && history.size(0) == 3 && history.size(1) > 0 &&
                  history.scalar_type() == at::kFloat && history.device().is_cpu() &&
                  history.is_contiguous(),
              "an amax history is a contiguous (3, length) CPU float32 tensor");
  if (histories == nullptr) histories = new std::vector<Tensor>();
  histories->push_back(history);
  return int64_t(histories->size()) - 1;
}

Spec saved_spec(AutogradContext* ctx, const std::string& name) {
  return ctx->saved_data[name].toDoubleVector();
}

}  // namespace
