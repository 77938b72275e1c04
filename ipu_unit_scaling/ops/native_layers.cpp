// The two autograd Functions of a unit-scaled transformer layer (`fused_blocks.norm_qkv` and
// `fused_blocks.proj_norm_mlp`), float or FP8 linears, and the FP8 linear on its own
// (`fp8.linear.native_linear`), as C++ autograd nodes; their casts in native_casts.hpp.
//
// The Python Functions compute the same ops; what this saves is the interpreter: at small
// widths the Python that calls some thirty kernels per layer, forward and backward, is a
// visible share of a CPU training step, and torch's own layers pay none of it. Every op here
// is the one the Python form calls, with the same arguments, in the same order, so the two
// forms give the same values (see tests/ops/test_native_layers.py).
//
// Built on first use by `ipu_unit_scaling.ops.native_layers`, against the installed torch.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "native_casts.hpp"

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

// alpha * a @ b.T (+ beta * bias): the unit-scaled linear's GEMM, its scale riding the GEMM;
// beta is the linear's output scale, alpha that times what is folded into `a`'s scale.
Tensor linear_forward(const Tensor& rows, const Tensor& weight, const Tensor& bias,
                      double alpha, double beta) {
  if (bias.defined()) return at::addmm(bias, rows, weight.t(), beta, alpha);
  return at::addmm(zero_like(rows), rows, weight.t(), 0.0, alpha);
}

Tensor linear_forward(const Tensor& rows, const Tensor& weight, const Tensor& bias,
                      double alpha) {
  return linear_forward(rows, weight, bias, alpha, alpha);
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
  // The layer norm of the joined stream and the QKV projection, with the projection's casts
  // (input, weight, grad_output; empty for a float linear).
  static variable_list forward(AutogradContext* ctx, Tensor x, OptTensor f,
                               double branch_weight, double skip_weight,
                               double next_branch_weight, double next_skip_weight,
                               OptTensor weight, OptTensor bias, double eps,
                               double param_grad_scale, Tensor qkv_weight, OptTensor qkv_bias,
                               std::vector<double> qkv_scales, Spec input_cast,
                               Spec weight_cast, Spec grad_cast) {
    ctx->set_materialize_grads(false);
    Tensor w = or_undefined(weight), b = or_undefined(bias), f_ = or_undefined(f);
    Tensor qb = or_undefined(qkv_bias);
    int64_t needs_mask = requires_grad_mask(
        {{0, &x}, {1, &f_}, {6, &w}, {7, &b}, {10, &qkv_weight}, {11, &qb}});
    auto need = [&](int position) { return bool((needs_mask >> position) & 1); };
    auto joined = join_norm(x, f_, branch_weight, skip_weight, w, b, eps);
    Tensor normed = joined[0], stream = joined[1];
    auto rows = cast_operand(normed.view({-1, normed.size(-1)}), input_cast, need(10),
                             "qkv.input", true);
    auto cast_weight = cast_operand(qkv_weight, weight_cast,
                                    need(0) || need(1) || need(6) || need(7), "qkv.weight");
    Tensor qkv = linear_forward(rows.first, cast_weight.first, qb, qkv_scales[0]);
    ctx->save_for_backward({stream, joined[2], joined[3], w, b, rows.second,
                            cast_weight.second});
    ctx->saved_data["joined"] = f_.defined();
    ctx->saved_data["weights"] = std::vector<double>{
        next_branch_weight, next_skip_weight, param_grad_scale, qkv_scales[1], qkv_scales[2]};
    ctx->saved_data["has_bias"] = qkv_bias.has_value();
    ctx->saved_data["grad_cast"] = grad_cast;
    ctx->saved_data["needs"] = needs_mask;
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
      // (into a kept buffer: grads[0] is the engine's, which other nodes may also read)
      auto grad = cast_operand(grad_rows, saved_spec(ctx, "grad_cast"), needs(ctx, 10),
                               "qkv.grad");
      grad_normed = scaled_mm(grad.first, qkv_weight,
                              w[3] * (next_branch_weight != 0.0 ? next_branch_weight : 1.0));
      if (needs(ctx, 10)) grad_qkv_w = scaled_mm(grad.second.t(), rows, w[4]);
      if (has_bias && needs(ctx, 11)) grad_qkv_b = grad_rows.sum(0).mul_(w[4]);
      grad_normed = grad_normed.view(stream.sizes());
    }
    auto g = join_norm_backward(grad_normed, grads[1], stream, mean, rstd, weight, bias,
                                next_branch_weight, next_skip_weight, param_grad_scale,
                                needs(ctx, 6), needs(ctx, 7), next_branch_weight != 0.0);
    bool joined = ctx->saved_data["joined"].toBool();
    return {g[0], joined ? g[0] : Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            g[1], g[2], Tensor(), Tensor(), grad_qkv_w, grad_qkv_b, Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

// (hidden, activated for the down projection's weight gradient, out) of the FP8 MLP on 2-D
// rows (see `fused_blocks._mlp_forward`); s: the MLP's scales, the down output's times the
// next join's branch weight where the forward pass folds it in.
std::vector<Tensor> mlp_forward(const Tensor& rows, const Tensor& up_weight,
                                 const Tensor& up_bias, const Tensor& down_weight,
                                 const Tensor& down_bias, const std::string& approximate,
                                 const std::vector<double>& s, const Spec& down_input,
                                 bool transposed) {
  double gelu_out = s[3];
  Tensor hidden = linear_forward(rows, up_weight, up_bias, s[0]);
  Tensor activated = at::gelu(hidden, approximate);
  Tensor activated_t = activated;
  if (!down_input.empty()) {
    auto cast =
        cast_operand(activated.mul_(gelu_out), down_input, transposed, "down.input", true);
    activated = cast.first;
    activated_t = cast.second;
    gelu_out = 1.0;
  }
  Tensor out = linear_forward(activated, down_weight, down_bias, s[5] * gelu_out, s[5]);
  return {hidden, activated_t, out};
}

struct ProjNormMLP : public torch::autograd::Function<ProjNormMLP> {
  // Inputs, in order (the indices of needs_input_grad): 0 heads (batch, heads, seq, head_dim),
  // 1 row_scale_tensor, 2 row_scale, 3 proj_weight, 4 proj_scales, 5 stream, 6 norm_weight,
  // 7 norm_bias, 8 residual, 9 up_weight, 10 up_bias, 11 down_weight, 12 down_bias,
  // 13 approximate, 14 mlp_scales, 15 the casts of the projection, the up and the down
  // linears (input, weight, grad_output each; empty for a float linear). The row scale is
  // the tensor where one is given, else the float. The scales are those of `_ProjNormMLP`.
  static variable_list forward(AutogradContext* ctx, Tensor heads, OptTensor row_scale_tensor,
                               double row_scale, Tensor proj_weight,
                               std::vector<double> proj_scales, Tensor stream,
                               OptTensor norm_weight, OptTensor norm_bias,
                               std::vector<double> residual, Tensor up_weight,
                               OptTensor up_bias, Tensor down_weight, OptTensor down_bias,
                               std::string approximate, std::vector<double> mlp_scales,
                               std::vector<Spec> casts) {
    ctx->set_materialize_grads(false);
    TORCH_CHECK(casts.size() == 9, "proj_norm_mlp takes nine cast specs");
    double branch_weight = residual[0], skip_weight = residual[1], eps = residual[4],
           output_weight = residual[6];
    Tensor row_scales = or_undefined(row_scale_tensor);
    Tensor nw = or_undefined(norm_weight), nb = or_undefined(norm_bias);
    Tensor ub = or_undefined(up_bias), db = or_undefined(down_bias);
    int64_t needs_mask = requires_grad_mask(
        {{0, &heads}, {1, &row_scales}, {3, &proj_weight}, {5, &stream}, {6, &nw}, {7, &nb},
         {9, &up_weight}, {10, &ub}, {11, &down_weight}, {12, &db}});
    auto need = [&](int position) { return bool((needs_mask >> position) & 1); };
    bool need_normed = need(0) || need(5) || need(6) || need(7);
    bool proj_float = casts[0].empty();
    int64_t batch = heads.size(0), count = heads.size(1), seq = heads.size(2),
            head_dim = heads.size(3);
    Tensor attended;
    if (proj_float) {
      attended = heads.transpose(1, 2).reshape({batch * seq, count * head_dim});
    } else {
      // An FP8 projection casts its input as it comes: row-scaled, in the copy that joins
      // the heads.
      attended = pooled("proj.heads", {batch * seq, count * head_dim}, heads.options());
      Tensor view = attended.view({batch, seq, count, head_dim});
      if (row_scales.defined()) {
        at::mul_out(view, heads.transpose(1, 2), row_scales.view({seq, 1, 1}));
      } else {
        at::mul_out(view, heads.transpose(1, 2), at::scalar_tensor(row_scale, heads.options()));
      }
    }
    auto proj_in = cast_operand(attended, casts[0], need(3), "proj.input", true);
    auto proj_w = cast_operand(proj_weight, casts[1], need(0), "proj.weight");
    Tensor joined =
        linear_forward(proj_in.first, proj_w.first, Tensor(), proj_scales[0] * branch_weight)
            .view(stream.sizes());
    if (proj_float) {
      if (row_scales.defined()) {
        joined.mul_(row_scales);
      } else {
        joined.mul_(row_scale);
      }
    }
    joined.add_(stream, skip_weight);
    auto norm = at::native_layer_norm(joined, {joined.size(-1)}, nw, nb, eps);
    Tensor normed = std::get<0>(norm);
    auto rows = cast_operand(normed.view({-1, normed.size(-1)}), casts[3], need(9),
                             "up.input", true);
    auto up_cast = cast_operand(up_weight, casts[4], need_normed, "up.weight");
    bool any_before_down = need_normed || need(1) || need(3) || need(9) || need(10);
    auto down_cast = cast_operand(down_weight, casts[7], any_before_down, "down.weight");
    std::vector<double> forward_scales = mlp_scales;
    forward_scales[5] *= output_weight;
    auto mlp = mlp_forward(rows.first, up_cast.first, ub, down_cast.first, db, approximate,
                            forward_scales, casts[6], need(11));
    bool grouped = !rows.second.is_same(rows.first) || !up_cast.second.is_same(up_cast.first);
    ctx->save_for_backward({proj_in.second, proj_w.second, joined, std::get<1>(norm),
                            std::get<2>(norm), nw, nb, rows.second, up_cast.second, ub,
                            down_cast.second, row_scales, grouped ? up_weight : Tensor(),
                            grouped ? down_weight : Tensor()});
    // Kept apart from the saved tensors so that backward frees each once used; gone (a
    // second backward, retain_graph=True): recomputed.
    ctx->saved_data["hidden"] = mlp[0];
    ctx->saved_data["activated"] = mlp[1];
    ctx->saved_data["row_scale"] = row_scale;
    ctx->saved_data["head_dim"] = head_dim;
    ctx->saved_data["proj_scales"] = proj_scales;
    ctx->saved_data["residual"] = residual;
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["mlp_scales"] = mlp_scales;
    ctx->saved_data["has_down_bias"] = down_bias.has_value();
    ctx->saved_data["grouped"] = grouped;
    for (int i = 0; i < 9; ++i) ctx->saved_data["cast" + std::to_string(i)] = casts[i];
    ctx->saved_data["needs"] = needs_mask;
    return {mlp[2].view(with_last(stream.sizes(), mlp[2].size(-1))), joined};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &attended = saved[0], &proj_weight = saved[1], &joined = saved[2],
                 &mean = saved[3], &rstd = saved[4], &norm_weight = saved[5],
                 &norm_bias = saved[6], &rows = saved[7], &up_weight = saved[8],
                 &up_bias = saved[9], &down_weight = saved[10], &row_scales = saved[11],
                 &up_float = saved[12], &down_float = saved[13];
    std::vector<Spec> casts;
    for (int i = 0; i < 9; ++i) casts.push_back(saved_spec(ctx, "cast" + std::to_string(i)));
    auto residual = ctx->saved_data["residual"].toDoubleVector();
    auto proj_scales = ctx->saved_data["proj_scales"].toDoubleVector();
    std::vector<double> s = ctx->saved_data["mlp_scales"].toDoubleVector();
    std::string approximate = ctx->saved_data["approximate"].toStringRef();
    double next_branch_weight = residual[2], next_skip_weight = residual[3],
           param_grad_scale = residual[5], eps = residual[4];
    bool proj_float = casts[0].empty(), down_float_linear = casts[6].empty();
    variable_list out(16);
    Tensor grad_normed;
    if (grads[0].defined()) {
      Tensor hidden, activated;
      if (ctx->saved_data.count("hidden")) {
        hidden = ctx->saved_data["hidden"].toTensor();
        activated = ctx->saved_data["activated"].toTensor();
        ctx->saved_data.erase("hidden");
        ctx->saved_data.erase("activated");
      } else if (!ctx->saved_data["grouped"].toBool()) {
        auto mlp = mlp_forward(rows, up_weight, up_bias, down_weight, Tensor(), approximate,
                                s, casts[6], needs(ctx, 11));
        hidden = mlp[0];
        activated = mlp[1];
      } else {
        // The forward GEMMs' operands, not kept: cast again from the norm's output.
        Tensor normed = std::get<0>(at::native_layer_norm(joined, {joined.size(-1)},
                                                          norm_weight, norm_bias, eps));
        auto mlp = mlp_forward(
            cast_operand(normed.view({-1, normed.size(-1)}), casts[3], false).first,
            cast_operand(up_float, casts[4], false).first, up_bias,
            cast_operand(down_float, casts[7], false).first, Tensor(), approximate, s,
            casts[6], needs(ctx, 11));
        hidden = mlp[0];
        activated = mlp[1];
      }
      // s: up output, up grad input, up grad weight, gelu output, gelu grad, down output,
      // down grad input, down grad weight.
      double gelu_out = s[3];
      Tensor grad_rows = grads[0].reshape({-1, grads[0].size(-1)});
      std::pair<Tensor, Tensor> grad_down{grad_rows, grad_rows};
      if (!down_float_linear) {
        // (into a kept buffer: grads[0] is the engine's, and the down bias sums it after)
        grad_down = cast_operand(grad_rows, casts[8], needs(ctx, 11), "down.grad");
        gelu_out = 1.0;
      }
      if (needs(ctx, 11)) out[11] = scaled_mm(grad_down.second.t(), activated, s[7] * gelu_out);
      activated.reset();
      grad_down.second.reset();
      if (ctx->saved_data["has_down_bias"].toBool() && needs(ctx, 12))
        out[12] = grad_rows.sum(0).mul_(s[7]);
      Tensor grad_activated = scaled_mm(grad_down.first, down_weight, s[6] * s[4]);
      grad_down.first.reset();
      Tensor grad_hidden = at::gelu_backward(grad_activated, hidden, approximate);
      grad_activated.reset();
      hidden.reset();
      // (the bias gradient sums the float values: taken before the cast may overwrite them)
      if (up_bias.defined() && needs(ctx, 10)) out[10] = grad_hidden.sum(0).mul_(s[2]);
      // Safe to overwrite: grad_hidden is this node's own temporary, read by nothing after.
      auto grad_up = cast_operand(grad_hidden, casts[5], needs(ctx, 9), "up.grad", true);
      grad_hidden.reset();
      double input_weight = next_branch_weight != 0.0 ? next_branch_weight : 1.0;
      grad_normed =
          scaled_mm(grad_up.first, up_weight, s[1] * input_weight).view(joined.sizes());
      if (needs(ctx, 9)) out[9] = scaled_mm(grad_up.second.t(), rows, s[2]);
    }
    auto g = join_norm_backward(grad_normed, grads[1], joined, mean, rstd, norm_weight,
                                norm_bias, next_branch_weight, next_skip_weight,
                                param_grad_scale, needs(ctx, 6), needs(ctx, 7),
                                next_branch_weight != 0.0);
    grad_normed.reset();
    Tensor grad_joined = g[0];
    if (!grad_joined.defined()) return variable_list(16);
    out[5] = grad_joined;
    out[6] = g[1];
    out[7] = g[2];
    Tensor grad_rows, grad_rows_t;
    if (proj_float) {
      Tensor grad = row_scales.defined()
                        ? grad_joined * row_scales
                        : grad_joined * ctx->saved_data["row_scale"].toDouble();
      grad_rows = grad_rows_t = grad.reshape({-1, grad.size(-1)});
    } else {
      // (into a kept buffer: grad_joined is also returned, the stream's gradient)
      auto grad = cast_operand(grad_joined.view({-1, grad_joined.size(-1)}), casts[2],
                               needs(ctx, 3), "proj.grad");
      grad_rows = grad.first;
      grad_rows_t = grad.second;
    }
    if (needs(ctx, 3)) out[3] = scaled_mm(grad_rows_t.t(), attended, proj_scales[2]);
    if (needs(ctx, 0)) {
      int64_t head_dim = ctx->saved_data["head_dim"].toInt();
      int64_t batch = joined.size(0), seq = joined.size(1);
      Tensor grad_heads = scaled_mm(grad_rows, proj_weight, proj_scales[1])
                              .view({batch, seq, -1, head_dim});
      if (!proj_float) {
        if (row_scales.defined()) {
          grad_heads.mul_(row_scales.view({seq, 1, 1}));
        } else {
          grad_heads.mul_(ctx->saved_data["row_scale"].toDouble());
        }
      }
      out[0] = grad_heads.transpose(1, 2);
    }
    return out;
  }
};

// alpha * a @ b as the Python FP8 linears compute it (`fp8.linear._gemm`,
// `fp8.recipe_linear._gemm`): a plain product where alpha is 1.
Tensor linear_gemm(const Tensor& a, const Tensor& b, double alpha) {
  return alpha == 1.0 ? at::mm(a, b) : scaled_mm(a, b, alpha);
}

struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  // An FP8 linear on its operands' FP8 values in float32: `fp8.linear._FP8ValuesLinear`
  // (per-tensor casts) and `fp8.recipe_linear._RecipeLinear` (delayed and grouped recipes)
  // on CPU float32 tensors. scales: (output, grad input, grad weight, grad bias); casts:
  // (input, weight, grad_output); slot: the prefix of its buffers' slots (the linear's site).
  static variable_list forward(AutogradContext* ctx, Tensor x, Tensor weight, OptTensor bias,
                               std::vector<double> scales, std::vector<Spec> casts,
                               std::string slot) {
    TORCH_CHECK(casts.size() == 3 && scales.size() == 4,
                "fp8_linear takes three cast specs and four scales");
    Tensor b = or_undefined(bias);
    int64_t needs_mask = requires_grad_mask({{0, &x}, {1, &weight}, {2, &b}});
    bool need_x = (needs_mask >> 0) & 1, need_w = (needs_mask >> 1) & 1;
    auto rows = cast_operand(x.reshape({-1, x.size(-1)}), casts[0], need_w, slot + ".input");
    auto cast_weight = cast_operand(weight, casts[1], need_x, slot + ".weight");
    Tensor y = linear_gemm(rows.first, cast_weight.first.t(), scales[0]);
    if (b.defined()) y.add_(b, scales[0]);  // (before the output scale, as `U.linear`'s)
    ctx->save_for_backward({need_w ? rows.second : Tensor(),
                            need_x ? cast_weight.second : Tensor()});
    ctx->saved_data["scales"] = scales;
    ctx->saved_data["grad_cast"] = casts[2];
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["needs"] = needs_mask;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return {y.view(with_last(x.sizes(), weight.size(0)))};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto scales = ctx->saved_data["scales"].toDoubleVector();
    Tensor grad_rows = grads[0].reshape({-1, grads[0].size(-1)});
    bool need_x = needs(ctx, 0), need_w = needs(ctx, 1);
    Tensor grad_x, grad_w, grad_b;
    // (cast whether or not a GEMM reads it, as the Python Functions do: a delayed cast pushes
    // its amax; into a kept buffer: grads[0] is the engine's, which other nodes may read)
    auto grad = cast_operand(grad_rows, saved_spec(ctx, "grad_cast"), need_w,
                             ctx->saved_data["slot"].toStringRef() + ".grad");
    if (need_x)
      grad_x = linear_gemm(grad.first, saved[1], scales[1])
                   .view(ctx->saved_data["x_sizes"].toIntVector());
    if (need_w) grad_w = linear_gemm(grad.second.t(), saved[0], scales[2]);
    if (needs(ctx, 2)) {
      grad_b = grad_rows.sum(0);
      if (scales[3] != 1.0) grad_b.mul_(scales[3]);
    }
    return {grad_x, grad_w, grad_b, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

std::vector<Tensor> norm_qkv(Tensor x, OptTensor f, double branch_weight, double skip_weight,
                             double next_branch_weight, double next_skip_weight,
                             OptTensor weight, OptTensor bias, double eps,
                             double param_grad_scale, Tensor qkv_weight, OptTensor qkv_bias,
                             std::vector<double> qkv_scales, std::vector<Spec> casts) {
  TORCH_CHECK(casts.size() == 3, "norm_qkv takes three cast specs");
  return NormQKV::apply(x, f, branch_weight, skip_weight, next_branch_weight,
                        next_skip_weight, weight, bias, eps, param_grad_scale, qkv_weight,
                        qkv_bias, qkv_scales, casts[0], casts[1], casts[2]);
}

std::vector<Tensor> proj_norm_mlp(Tensor heads, OptTensor row_scale_tensor, double row_scale,
                                  Tensor proj_weight, std::vector<double> proj_scales,
                                  Tensor stream, OptTensor norm_weight, OptTensor norm_bias,
                                  std::vector<double> residual, Tensor up_weight,
                                  OptTensor up_bias, Tensor down_weight, OptTensor down_bias,
                                  std::string approximate, std::vector<double> mlp_scales,
                                  std::vector<Spec> casts) {
  return ProjNormMLP::apply(heads, row_scale_tensor, row_scale, proj_weight, proj_scales,
                            stream, norm_weight, norm_bias, residual, up_weight, up_bias,
                            down_weight, down_bias, approximate, mlp_scales, casts);
}

Tensor fp8_linear(Tensor x, Tensor weight, OptTensor bias, std::vector<double> scales,
                  std::vector<Spec> casts, std::string slot) {
  return Fp8Linear::apply(x, weight, bias, scales, casts, slot)[0];
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_linear", &fp8_linear,
        "an FP8 linear on its operands' FP8 values (casts as the layer nodes take them)");
  m.def("hold_history", &hold_history,
        "holds a delayed FP8 linear's amax history for the casts of kind 4; its index");
  m.def("norm_qkv", &norm_qkv,
        "fused_blocks.norm_qkv as a C++ node (a float QKV projection where its specs are empty)");
  m.def("proj_norm_mlp", &proj_norm_mlp,
        "fused_blocks.proj_norm_mlp as a C++ node (float linears where their specs are empty)");
  m.def("kept_buffers", &kept_buffers,
        "the buffers the FP8 nodes keep for this thread: (slot, elements) each");
  m.def("set_fp8_casts", &set_fp8_casts,
        "the host library's cast and amax kernels (addresses) and the Python quantiser to "
        "fall back on");
}
