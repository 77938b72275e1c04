"""The ops of current language models: RMSNorm, SiLU and SwiGLU, grouped-query attention, and
the masked (ignore_index) cross-entropy of masked-LM training, each against its scaling rule
and against independent float64 references."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import run_op

import ipu_unit_scaling as uu
import ipu_unit_scaling.functional as U
from ipu_unit_scaling.ipu import ipu_tracing
from ipu_unit_scaling.ops.llm_ops import SILU_MOMENTS

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics


def assert_unit(value: float, tol: float = 0.2, what: str = "") -> None:
    assert abs(value - 1) <= tol, f"{what} std {value:.3f} is not within {tol} of 1"


def _normal_moment(f) -> float:
    """E[f(z)] for z ~ N(0, 1) by the trapezoid rule on a fine grid over [-40, 40]: for smooth,
    fast-decaying integrands it converges geometrically, and it shares nothing with the op's
    Gauss-Hermite quadrature."""
    z, step = np.linspace(-40.0, 40.0, 400_001, retstep=True)
    values = f(z) * np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return float((values.sum() - (values[0] + values[-1]) / 2) * step)


def test_silu_moments_match_adaptive_quadrature():
    def silu(z: np.ndarray) -> np.ndarray:
        return z / (1 + np.exp(-z))

    def slope(z: np.ndarray) -> np.ndarray:
        s = 1 / (1 + np.exp(-z))
        return s * (1 + z * (1 - s))

    mean = _normal_moment(silu)
    mean_square = _normal_moment(lambda z: silu(z) ** 2)
    out_std, out_rms, slope_rms = SILU_MOMENTS
    assert out_std == pytest.approx(math.sqrt(mean_square - mean**2), rel=1e-9)
    assert out_rms == pytest.approx(math.sqrt(mean_square), rel=1e-9)
    assert slope_rms == pytest.approx(math.sqrt(_normal_moment(lambda z: slope(z) ** 2)), rel=1e-9)


def test_silu_and_silu_glu_compute_torch_values_up_to_their_output_scale():
    x, g = (torch.randn(16, 32, dtype=torch.float64) for _ in range(2))
    out_std, out_rms, _ = SILU_MOMENTS
    torch.testing.assert_close(U.silu(x, constraint="to_output_scale"), F.silu(x) / out_std)
    torch.testing.assert_close(U.silu_glu(x, g, constraint="to_output_scale"),
                               x * F.silu(g) / out_rms)


# ---------------------------------------------------------------- RMSNorm


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + eps) * weight.double()).float()


@pytest.mark.parametrize("shape", [(2048, 64), (8, 128, 256), (2, 1024, 32)])
def test_rms_norm_is_unit_with_unit_weight_grad(shape):
    hidden = shape[-1]
    weight = torch.ones(hidden, requires_grad=True)
    out_std, (grad_std,) = run_op(lambda x: U.rms_norm(x, (hidden,), weight, 1e-6), [shape])
    assert_unit(out_std, what="rms_norm output")
    assert_unit(grad_std, what="rms_norm input grad")
    assert_unit(weight.grad.std().item(), 0.25, "rms_norm weight grad")


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_rms_norm_value_and_gradient_match_float64(traced):
    """Value against the formula in float64; the gradient is autograd's of the formula, with
    the weight's documented grad scale rows**-0.5."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(6, 5, 16, generator=gen)).requires_grad_()
    weight = (1 + 0.1 * torch.randn(16, generator=gen)).requires_grad_()
    with ipu_tracing() if traced else torch.enable_grad():
        out = U.rms_norm(x, 16, weight, 1e-5)
    reference_x = x.detach().double().requires_grad_()
    reference_w = weight.detach().double().requires_grad_()
    reference = reference_x / torch.sqrt((reference_x**2).mean(-1, keepdim=True) + 1e-5)
    reference = reference * reference_w
    torch.testing.assert_close(out.double(), reference.detach(), rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad.float())
    reference.backward(grad)
    torch.testing.assert_close(x.grad.double(), reference_x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), reference_w.grad * 30**-0.5,
                               rtol=1e-4, atol=1e-5)


def test_rms_norm_default_eps_and_half_inputs():
    x = torch.randn(4, 8).half()
    out = U.rms_norm(x, (8,))
    assert out.dtype == torch.float16
    expected = _rms_norm_reference(x.float(), torch.ones(8), torch.finfo(torch.float16).eps)
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="normalized_shape"):
        U.rms_norm(x, (4,))


def test_rms_norm_module_matches_torch_state_and_function():
    module = uu.RMSNorm(32, eps=1e-6, elementwise_affine=True)
    assert torch.equal(module.weight, torch.ones(32))
    x = torch.randn(3, 32)
    torch.testing.assert_close(module(x), _rms_norm_reference(x, module.weight, 1e-6))
    if hasattr(torch.nn, "RMSNorm"):
        assert isinstance(module, torch.nn.RMSNorm)
        assert module.state_dict().keys() == torch.nn.RMSNorm(32).state_dict().keys()


# ---------------------------------------------------------------- gated MLP


@pytest.mark.parametrize("intermediate", [96, 128, 172])  # Llama: 8/3 x hidden
def test_gated_mlp_scales_are_the_documented_composition(intermediate):
    """Unit-scaled parts, gmean ties: the two projections that share the input sit at
    (2 intermediate / hidden)**-0.25, which the product squares; the input gradient stays
    near unit (one shared grad-input scale, not two summed ones)."""
    torch.manual_seed(0)
    mlp = uu.GatedMLP(64, intermediate)
    x = torch.randn(32, 64, 64, requires_grad=True)
    out = mlp(x)
    out.backward(torch.randn_like(out))
    factor = (2 * intermediate / 64) ** -0.25
    for projection in (mlp.gate, mlp.up):
        assert projection(x).std().item() == pytest.approx(factor, rel=0.05)
    assert 0.45 < out.std().item() < 1.0
    assert 0.7 < x.grad.std().item() < 1.1
    for name, parameter in mlp.named_parameters():
        assert 0.35 < parameter.grad.std().item() < 1.0, name


def test_plain_gated_mlp_is_the_swiglu_formula():
    torch.manual_seed(0)
    mlp = uu.GatedMLP(8, 16, ops=uu.TORCH_OPS)
    x = torch.randn(3, 8)
    expected = mlp.down(mlp.up(x) * F.silu(mlp.gate(x)))
    torch.testing.assert_close(mlp(x), expected)


# ---------------------------------------------------------------- grouped-query attention


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa_output_and_query_grad_unit_key_value_grads_sqrt_groups(groups, is_causal):
    kv_heads, seq, width = 2, 256, 32
    out_std, (q, k, v) = run_op(
        lambda q, k, v: U.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=width**-0.5, enable_gqa=True),
        [(2, kv_heads * groups, seq, width), (2, kv_heads, seq, width),
         (2, kv_heads, seq, width)],
    )
    assert_unit(out_std, what="gqa output")
    assert_unit(q, what="gqa query grad")
    for name, std in (("key", k), ("value", v)):
        ratio = std / math.sqrt(groups)
        assert abs(ratio - 1) < 0.2, f"{name} grad std {std:.3f}, expected sqrt({groups})"


def test_gqa_equals_attention_on_repeated_heads_and_torch():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    out = U.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)
    k_rep, v_rep = (t.detach().repeat_interleave(3, dim=1).requires_grad_() for t in (k, v))
    q_ref = q.detach().clone().requires_grad_()
    reference = U.scaled_dot_product_attention(q_ref, k_rep, v_rep, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, reference)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad)
    reference.backward(grad)
    # The gradient of a shared head is the sum over the query heads that use it.
    torch.testing.assert_close(k.grad, k_rep.grad.view(2, 2, 3, 5, 4).sum(2))
    torch.testing.assert_close(v.grad, v_rep.grad.view(2, 2, 3, 5, 4).sum(2))
    if "enable_gqa" in F.scaled_dot_product_attention.__doc__:  # torch >= 2.5
        plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ratio = out / plain
        torch.testing.assert_close(ratio, ratio[:1, :1, :, :1].expand_as(ratio))


# ---------------------------------------------------------------- masked cross-entropy


def _masked_targets(rows: int, classes: int, keep: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[torch.rand(rows, generator=gen) >= keep] = -100
    return target


@pytest.mark.parametrize("keep", [0.15, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_masked_cross_entropy_value_and_unit_gradient_over_all_rows(keep, seed):
    rows, classes = 4096, 96
    target = _masked_targets(rows, classes, keep, seed)
    logits = torch.randn(rows, classes, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(seed + 10), requires_grad=True)
    loss = U.cross_entropy(logits, target)
    reference = F.cross_entropy(logits.detach(), target)
    assert abs(loss.item() - reference.item()) <= 1e-9 * reference.item()
    loss.backward()
    grad = logits.grad
    counted = int((target != -100).sum())
    # Unit mean square over the whole tensor: rows with a target carry sqrt(N / C) each.
    assert_unit(grad.pow(2).mean().sqrt().item(), 0.1, "masked cross_entropy grad rms")
    assert torch.all(grad[target == -100] == 0)
    kept_rms = grad[target != -100].pow(2).mean().sqrt().item()
    assert kept_rms == pytest.approx(math.sqrt(rows / counted), rel=0.1)


def test_masked_cross_entropy_gradient_is_torch_gradient_times_the_documented_scale():
    rows, classes = 64, 10
    target = _masked_targets(rows, classes, 0.3, 3)
    counted = int((target != -100).sum())
    logits = torch.randn(rows, classes, dtype=torch.float64, requires_grad=True)
    U.cross_entropy(logits, target).backward()
    reference_logits = logits.detach().clone().requires_grad_()
    F.cross_entropy(reference_logits, target).backward()
    # Expected sum of squared softmax probabilities for 10 unit-normal logits, computed
    # independently by Monte Carlo (the op uses a closed-form approximation within 5%).
    z = torch.randn(200_000, classes, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(5))
    square_sum = torch.softmax(z, -1).pow(2).sum(-1).mean().item()
    per_element_var = (1 - 2 / classes + square_sum) / classes
    expected = reference_logits.grad * math.sqrt(counted * rows) / math.sqrt(per_element_var)
    ratio = (logits.grad[target != -100] / expected[target != -100]).flatten()
    torch.testing.assert_close(ratio, torch.full_like(ratio, ratio[0].item()))
    assert ratio[0].item() == pytest.approx(1.0, abs=0.05)


def test_masked_cross_entropy_sequence_layout_and_traced_form_agree():
    logits = torch.randn(4, 30, 64, requires_grad=True)  # (batch, classes, seq)
    target = torch.randint(0, 30, (4, 64))
    target[:, ::3] = 7
    eager = U.cross_entropy(logits, target, ignore_index=7)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    with ipu_tracing():
        traced = U.cross_entropy(logits, target, ignore_index=7)
    (traced_grad,) = torch.autograd.grad(traced, logits)
    torch.testing.assert_close(eager, F.cross_entropy(logits, target, ignore_index=7))
    torch.testing.assert_close(traced, eager)
    torch.testing.assert_close(traced_grad, eager_grad)


def test_cross_entropy_with_class_probabilities_counts_rows_not_elements():
    logits = torch.randn(2048, 40, requires_grad=True)
    probabilities = torch.softmax(torch.randn(2048, 40), -1)
    loss = U.cross_entropy(logits, probabilities)
    torch.testing.assert_close(loss, F.cross_entropy(logits, probabilities))
    loss.backward()
    reference = logits.detach().clone().requires_grad_()
    F.cross_entropy(reference, probabilities).backward()
    ratio = logits.grad / reference.grad
    assert np.allclose(ratio.numpy(), ratio.flatten()[0].item(), rtol=1e-3)
    # The mean's 1/rows undone (rows, not rows x classes) times the per-row unit scale, with
    # the expected square sum of 40 softmax probabilities from Monte Carlo.
    z = torch.randn(100_000, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    square_sum = torch.softmax(z, -1).pow(2).sum(-1).mean().item()
    expected = 2048 * math.sqrt(40 / (1 - 2 / 40 + square_sum))
    assert ratio.flatten()[0].item() == pytest.approx(expected, rel=0.05)


# ---------------------------------------------------------------- linears sharing an input


def test_shared_input_gmean_gives_the_shared_input_a_unit_gradient_and_true_gradients():
    from ipu_unit_scaling.constraints import SharedInputGmean

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=gen, requires_grad=True)
    weights = [torch.randn(out, 64, generator=gen) for out in (64, 32, 32)]  # q, k, v (GQA)

    def input_grad_std(constraint) -> float:
        x.grad = None
        outs = [U.linear(x, w, None, constraint) for w in weights]
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen) for o in outs])
        return x.grad.std().item()

    shared = SharedInputGmean(128)
    # As one fused 64 -> 128 linear under gmean: (128 / 64)**0.25; separately tied, the three
    # gradients add up to sqrt(1 + 2 (32 / 64)**0.5).
    assert input_grad_std(shared) == pytest.approx(2**0.25, rel=0.05)
    assert input_grad_std("gmean") == pytest.approx((1 + 2 * 0.5**0.5) ** 0.5, rel=0.05)
    # Each linear is scaled alike both ways: its input gradient is the true gradient of its
    # (scaled) forward function, here in float64.
    x64 = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(32, 64, dtype=torch.float64)
    out = U.linear(x64, w64, None, shared)
    (grad,) = torch.autograd.grad(out.sum(), x64)
    scale = (64 * 128) ** -0.25
    torch.testing.assert_close(out, x64 @ w64.T * scale)
    torch.testing.assert_close(grad, torch.ones(8, 32, dtype=torch.float64) @ w64 * scale)
