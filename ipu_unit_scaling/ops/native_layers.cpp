// The two autograd Functions of a unit-scaled transformer layer (`fused_blocks.norm_qkv` and
// `fused_blocks.proj_norm_mlp`, float linears) as C++ autograd nodes.
//
// The Python Functions compute the same ops; what this saves is the interpreter: at small
// widths the Python that calls some thirty kernels per layer, forward and backward, is a
// visible share of a CPU training step, and torch's own layers pay none of it. Every op here
// is the one the Python form calls, with the same arguments, in the same order, so the two
// forms give the same values (see tests/ops/test_native_layers.py).
//
// Built on first use by `ipu_unit_scaling.ops.native_layers`, against the installed torch.
#include <torch/extension.h>

#include <array>
#include <string>
#include <vector>

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<Tensor>;

Tensor zero_like(const Tensor& like) { return at::zeros({}, like.options()); }

Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

// Which inputs want a gradient, as a bit mask by argument position, taken at forward time as
// the Python Functions' ctx.needs_input_grad is (the context's own needs_input_grad counts
// only the tensors given, so its indices move with the optional ones).
int64_t requires_grad_mask(std::initializer_list<std::pair<int, const Tensor*>> inputs) {
  int64_t mask = 0;
  for (const auto& input : inputs)
    if (input.second->defined() && input.second->requires_grad()) mask |= int64_t(1) << input.first;
  return mask;
}

bool needs(AutogradContext* ctx, int position) {
  return (ctx->saved_data["needs"].toInt() >> position) & 1;
}

// alpha * a @ b.T (+ bias): the unit-scaled linear's GEMM, its scale riding the GEMM.
Tensor linear_forward(const Tensor& rows, const Tensor& weight, const Tensor& bias,
                      double alpha) {
  if (bias.defined()) return at::addmm(bias, rows, weight.t(), 1.0, alpha);
  return at::addmm(zero_like(rows), rows, weight.t(), 0.0, alpha);
}

Tensor scaled_mm(const Tensor& a, const Tensor& b, double alpha) {
  return at::addmm(zero_like(a), a, b, 0.0, alpha);
}

// The stream's gradient and the norm's weight and bias gradients (see `_join_norm_backward`).
std::vector<Tensor> join_norm_backward(Tensor grad_normed, Tensor grad_stream,
                                       const Tensor& stream, const Tensor& mean,
                                       const Tensor& rstd, const Tensor& weight,
                                       const Tensor& bias, double next_branch_weight,
                                       double next_skip_weight, double param_grad_scale,
                                       bool need_weight, bool need_bias, bool weighed) {
  if (!grad_normed.defined()) {
    if (grad_stream.defined() && next_skip_weight != 1.0)
      grad_stream = grad_stream * next_skip_weight;
    return {grad_stream, Tensor(), Tensor()};
  }
  if (weighed) {
    param_grad_scale /= next_branch_weight;
    next_branch_weight = 1.0;
  }
  std::array<bool, 3> mask = {true, weight.defined() && need_weight,
                              bias.defined() && need_bias};
  auto grads = at::native_layer_norm_backward(grad_normed.contiguous(), stream,
                                              {stream.size(-1)}, mean, rstd, weight, bias,
                                              mask);
  Tensor grad_branch = std::get<0>(grads);
  Tensor grad_w = std::get<1>(grads);
  Tensor grad_b = std::get<2>(grads);
  if (grad_w.defined()) grad_w.mul_(param_grad_scale);
  if (grad_b.defined()) grad_b.mul_(param_grad_scale);
  // In place on the norm's fresh gradient: no new buffer for the join.
  if (next_branch_weight != 1.0) grad_branch.mul_(next_branch_weight);
  if (grad_stream.defined()) grad_branch.add_(grad_stream, next_skip_weight);
  return {grad_branch, grad_w, grad_b};
}

// (normed, stream, mean, rstd) of the join and the layer norm (see `_join_norm`).
std::vector<Tensor> join_norm(const Tensor& x, const Tensor& f, double branch_weight,
                              double skip_weight, const Tensor& weight, const Tensor& bias,
                              double eps) {
  Tensor stream;
  if (!f.defined()) {
    stream = x.view_as(x);
  } else if (branch_weight == 1.0) {
    stream = at::add(f, x, skip_weight);
  } else {
    stream = at::mul(x, skip_weight).add_(f, branch_weight);
  }
  auto out = at::native_layer_norm(stream, {x.size(-1)}, weight, bias, eps);
  return {std::get<0>(out), stream, std::get<1>(out), std::get<2>(out)};
}

std::vector<int64_t> with_last(at::IntArrayRef shape, int64_t last) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  out.back() = last;
  return out;
}

struct NormQKV : public torch::autograd::Function<NormQKV> {
  static variable_list forward(AutogradContext* ctx, Tensor x, OptTensor f,
                               double branch_weight, double skip_weight,
                               double next_branch_weight, double next_skip_weight,
                               OptTensor weight, OptTensor bias, double eps,
                               double param_grad_scale, Tensor qkv_weight, OptTensor qkv_bias,
                               std::vector<double> qkv_scales) {
    ctx->set_materialize_grads(false);
    Tensor w = or_undefined(weight), b = or_undefined(bias), f_ = or_undefined(f);
    auto joined = join_norm(x, f_, branch_weight, skip_weight, w, b, eps);
    Tensor normed = joined[0], stream = joined[1];
    Tensor rows = normed.view({-1, normed.size(-1)});
    Tensor qkv = linear_forward(rows, qkv_weight, or_undefined(qkv_bias), qkv_scales[0]);
    ctx->save_for_backward({stream, joined[2], joined[3], w, b, rows, qkv_weight});
    ctx->saved_data["joined"] = f_.defined();
    ctx->saved_data["weights"] = std::vector<double>{
        next_branch_weight, next_skip_weight, param_grad_scale, qkv_scales[1], qkv_scales[2]};
    ctx->saved_data["has_bias"] = qkv_bias.has_value();
    Tensor qb = or_undefined(qkv_bias);
    ctx->saved_data["needs"] =
        requires_grad_mask({{6, &w}, {7, &b}, {10, &qkv_weight}, {11, &qb}});
    return {qkv.view(with_last(x.sizes(), qkv.size(-1))), stream};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &stream = saved[0], &mean = saved[1], &rstd = saved[2], &weight = saved[3],
                 &bias = saved[4], &rows = saved[5], &qkv_weight = saved[6];
    auto w = ctx->saved_data["weights"].toDoubleVector();
    double next_branch_weight = w[0], next_skip_weight = w[1], param_grad_scale = w[2];
    bool has_bias = ctx->saved_data["has_bias"].toBool();
    Tensor grad_normed, grad_qkv_w, grad_qkv_b;
    if (grads[0].defined()) {
      Tensor grad_rows = grads[0].reshape({-1, grads[0].size(-1)});
      grad_normed = scaled_mm(grad_rows, qkv_weight,
                              w[3] * (next_branch_weight != 0.0 ? next_branch_weight : 1.0));
      if (needs(ctx, 10))
        grad_qkv_w = scaled_mm(grad_rows.t(), rows, w[4]);
      if (has_bias && needs(ctx, 11)) grad_qkv_b = grad_rows.sum(0).mul_(w[4]);
      grad_normed = grad_normed.view(stream.sizes());
    }
    auto g = join_norm_backward(grad_normed, grads[1], stream, mean, rstd, weight, bias,
                                next_branch_weight, next_skip_weight, param_grad_scale,
                                needs(ctx, 6), needs(ctx, 7),
                                next_branch_weight != 0.0);
    bool joined = ctx->saved_data["joined"].toBool();
    return {g[0], joined ? g[0] : Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            g[1], g[2], Tensor(), Tensor(), grad_qkv_w, grad_qkv_b, Tensor()};
  }
};

// (hidden, activated) of the MLP's up projection and GELU on 2-D rows (see `_mlp_forward`).
std::vector<Tensor> mlp_hidden(const Tensor& rows, const Tensor& up_weight, const Tensor& up_bias,
                               const std::string& approximate, double up_out) {
  Tensor hidden = linear_forward(rows, up_weight, up_bias, up_out);
  return {hidden, at::gelu(hidden, approximate)};
}

struct ProjNormMLP : public torch::autograd::Function<ProjNormMLP> {
  // Inputs, in order (the indices of needs_input_grad): 0 heads (batch, heads, seq, head_dim),
  // 1 row_scale_tensor, 2 row_scale, 3 proj_weight, 4 proj_scales, 5 stream, 6 norm_weight,
  // 7 norm_bias, 8 residual, 9 up_weight, 10 up_bias, 11 down_weight, 12 down_bias,
  // 13 approximate, 14 mlp_scales. The row scale is the tensor where one is given, else the
  // float. The scales are those of `_ProjNormMLP`.
  static variable_list forward(AutogradContext* ctx, Tensor heads, OptTensor row_scale_tensor,
                               double row_scale, Tensor proj_weight,
                               std::vector<double> proj_scales, Tensor stream,
                               OptTensor norm_weight, OptTensor norm_bias,
                               std::vector<double> residual, Tensor up_weight,
                               OptTensor up_bias, Tensor down_weight, OptTensor down_bias,
                               std::string approximate, std::vector<double> mlp_scales) {
    ctx->set_materialize_grads(false);
    double branch_weight = residual[0], skip_weight = residual[1], eps = residual[4],
           output_weight = residual[6];
    int64_t batch = heads.size(0), count = heads.size(1), seq = heads.size(2),
            head_dim = heads.size(3);
    // The row scale commutes with the bias-free projection: applied to its output, the
    // projection reads the attention output itself, which the attention kernel keeps anyway.
    Tensor attended = heads.transpose(1, 2).reshape({batch * seq, count * head_dim});
    Tensor joined =
        linear_forward(attended, proj_weight, Tensor(), proj_scales[0] * branch_weight)
            .view(stream.sizes());
    Tensor row_scales = or_undefined(row_scale_tensor);
    if (row_scales.defined()) {
      joined.mul_(row_scales);
    } else {
      joined.mul_(row_scale);
    }
    joined.add_(stream, skip_weight);
    Tensor nw = or_undefined(norm_weight), nb = or_undefined(norm_bias);
    auto norm = at::native_layer_norm(joined, {joined.size(-1)}, nw, nb, eps);
    Tensor normed = std::get<0>(norm);
    Tensor rows = normed.view({-1, normed.size(-1)});
    Tensor ub = or_undefined(up_bias);
    auto mlp = mlp_hidden(rows, up_weight, ub, approximate, mlp_scales[0]);
    Tensor out = linear_forward(mlp[1], down_weight, or_undefined(down_bias),
                                mlp_scales[5] * output_weight * mlp_scales[3]);
    ctx->save_for_backward({attended, proj_weight, joined, std::get<1>(norm),
                            std::get<2>(norm), nw, nb, rows, up_weight, ub, down_weight,
                            row_scales});
    // Kept apart from the saved tensors so that backward frees each once used, as torch's
    // per-op nodes would; gone (a second backward, retain_graph=True): recomputed.
    ctx->saved_data["hidden"] = mlp[0];
    ctx->saved_data["activated"] = mlp[1];
    ctx->saved_data["row_scale"] = row_scale;
    ctx->saved_data["head_dim"] = head_dim;
    ctx->saved_data["proj_scales"] = proj_scales;
    ctx->saved_data["residual"] = residual;
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["mlp_scales"] = mlp_scales;
    ctx->saved_data["has_down_bias"] = down_bias.has_value();
    Tensor db = or_undefined(down_bias);
    ctx->saved_data["needs"] = requires_grad_mask(
        {{0, &heads}, {3, &proj_weight}, {6, &nw}, {7, &nb}, {9, &up_weight}, {10, &ub},
         {11, &down_weight}, {12, &db}});
    return {out.view(with_last(stream.sizes(), out.size(-1))), joined};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &attended = saved[0], &proj_weight = saved[1], &joined = saved[2],
                 &mean = saved[3], &rstd = saved[4], &norm_weight = saved[5],
                 &norm_bias = saved[6], &rows = saved[7], &up_weight = saved[8],
                 &up_bias = saved[9], &down_weight = saved[10], &row_scales = saved[11];
    auto residual = ctx->saved_data["residual"].toDoubleVector();
    auto proj_scales = ctx->saved_data["proj_scales"].toDoubleVector();
    auto s = ctx->saved_data["mlp_scales"].toDoubleVector();
    std::string approximate = ctx->saved_data["approximate"].toStringRef();
    double next_branch_weight = residual[2], next_skip_weight = residual[3],
           param_grad_scale = residual[5];
    variable_list out(15);
    Tensor grad_normed;
    if (grads[0].defined()) {
      Tensor hidden, activated;
      if (ctx->saved_data.count("hidden")) {
        hidden = ctx->saved_data["hidden"].toTensor();
        activated = ctx->saved_data["activated"].toTensor();
        ctx->saved_data.erase("hidden");
        ctx->saved_data.erase("activated");
      } else {
        auto mlp = mlp_hidden(rows, up_weight, up_bias, approximate, s[0]);
        hidden = mlp[0];
        activated = mlp[1];
      }
      // s: up output, up grad input, up grad weight, gelu output, gelu grad, down output,
      // down grad input, down grad weight.
      Tensor grad_rows = grads[0].reshape({-1, grads[0].size(-1)});
      if (needs(ctx, 11))
        out[11] = scaled_mm(grad_rows.t(), activated, s[7] * s[3]);
      activated.reset();
      if (ctx->saved_data["has_down_bias"].toBool() && needs(ctx, 12))
        out[12] = grad_rows.sum(0).mul_(s[7]);
      Tensor grad_activated = scaled_mm(grad_rows, down_weight, s[6] * s[4]);
      Tensor grad_hidden = at::gelu_backward(grad_activated, hidden, approximate);
      grad_activated.reset();
      hidden.reset();
      double input_weight = next_branch_weight != 0.0 ? next_branch_weight : 1.0;
      grad_normed = scaled_mm(grad_hidden, up_weight, s[1] * input_weight).view(joined.sizes());
      if (needs(ctx, 9)) out[9] = scaled_mm(grad_hidden.t(), rows, s[2]);
      if (up_bias.defined() && needs(ctx, 10))
        out[10] = grad_hidden.sum(0).mul_(s[2]);
    }
    auto g = join_norm_backward(grad_normed, grads[1], joined, mean, rstd, norm_weight,
                                norm_bias, next_branch_weight, next_skip_weight,
                                param_grad_scale, needs(ctx, 6),
                                needs(ctx, 7), next_branch_weight != 0.0);
    grad_normed.reset();
    Tensor grad_joined = g[0];
    if (!grad_joined.defined()) return variable_list(15);
    out[5] = grad_joined;
    out[6] = g[1];
    out[7] = g[2];
    Tensor grad = row_scales.defined()
                      ? grad_joined * row_scales
                      : grad_joined * ctx->saved_data["row_scale"].toDouble();
    Tensor grad_rows = grad.reshape({-1, grad.size(-1)});
    if (needs(ctx, 3))
      out[3] = scaled_mm(grad_rows.t(), attended.reshape({-1, attended.size(-1)}),
                         proj_scales[2]);
    if (needs(ctx, 0)) {
      int64_t head_dim = ctx->saved_data["head_dim"].toInt();
      out[0] = scaled_mm(grad_rows, proj_weight, proj_scales[1])
                   .view({joined.size(0), joined.size(1), -1, head_dim})
                   .transpose(1, 2);
    }
    return out;
  }
};

}  // namespace

std::vector<Tensor> norm_qkv(Tensor x, OptTensor f, double branch_weight, double skip_weight,
                             double next_branch_weight, double next_skip_weight,
                             OptTensor weight, OptTensor bias, double eps,
                             double param_grad_scale, Tensor qkv_weight, OptTensor qkv_bias,
                             std::vector<double> qkv_scales) {
  return NormQKV::apply(x, f, branch_weight, skip_weight, next_branch_weight,
                        next_skip_weight, weight, bias, eps, param_grad_scale, qkv_weight,
                        qkv_bias, qkv_scales);
}

std::vector<Tensor> proj_norm_mlp(Tensor heads, OptTensor row_scale_tensor, double row_scale,
                                  Tensor proj_weight, std::vector<double> proj_scales,
                                  Tensor stream, OptTensor norm_weight, OptTensor norm_bias,
                                  std::vector<double> residual, Tensor up_weight,
                                  OptTensor up_bias, Tensor down_weight, OptTensor down_bias,
                                  std::string approximate, std::vector<double> mlp_scales) {
  return ProjNormMLP::apply(heads, row_scale_tensor, row_scale, proj_weight, proj_scales,
                            stream, norm_weight, norm_bias, residual, up_weight, up_bias,
                            down_weight, down_bias, approximate, mlp_scales);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm_qkv", &norm_qkv, "fused_blocks.norm_qkv for float linears, as a C++ node");
  m.def("proj_norm_mlp", &proj_norm_mlp,
        "fused_blocks.proj_norm_mlp for float linears, as a C++ node");
}
