"""Every unit-scaled op keeps unit scale where its rule promises it, on unit-normal inputs."""

from __future__ import annotations

import math
from typing import Callable, List, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import run_op

import ipu_unit_scaling.functional as U
from ipu_unit_scaling.ops import unit_ops
from ipu_unit_scaling.scale import scale, scale_bwd, scale_fwd

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

UNIT_TOL = 0.2
PRODUCT_TOL = 0.15


def assert_unit(value: float, tol: float = UNIT_TOL, what: str = "") -> None:
    assert abs(value - 1) <= tol, f"{what} std {value:.3f} is not within {tol} of 1"


# (name, op taking a constraint, input shapes, (natural output scale, natural grad scales))
# The ideal scales are what the op's rule computes from the shapes.
CONSTRAINED_CASES: List[Tuple[str, Callable, Sequence[Tuple[int, ...]]]] = []


def _case(name: str, shapes: Sequence[Tuple[int, ...]], make: Callable) -> None:
    CONSTRAINED_CASES.append((name, make, shapes))


for batch, fan_in, fan_out in [(512, 64, 256), (4096, 256, 64), (2048, 128, 128)]:
    _case(
        f"linear-{batch}x{fan_in}->{fan_out}",
        [(batch // 16, 16, fan_in)],
        lambda c, fi=fan_in, fo=fan_out: (
            lambda x: U.linear(
                x, torch.randn(fo, fi, generator=torch.Generator().manual_seed(1)), None, c
            )
        ),
    )
for left, right in [((4, 64, 32), (32, 48)), ((8, 128, 64), (8, 64, 16)), ((256, 512), (512, 64))]:
    _case(f"matmul-{left}@{right}", [left, right], lambda c: lambda a, b: U.matmul(a, b, c))
for shape in [(64, 512), (8, 64, 256)]:
    _case(f"gelu-{shape}", [shape], lambda c: lambda x: U.gelu(x, constraint=c))
    _case(f"gelu-tanh-{shape}", [shape], lambda c: lambda x: U.gelu(x, "tanh", c))
    _case(f"relu-{shape}", [shape], lambda c: lambda x: U.relu(x, constraint=c))
for shape in [(64, 512), (8, 64, 256)]:
    _case(f"silu-{shape}", [shape], lambda c: lambda x: U.silu(x, constraint=c))
    _case(f"silu_glu-{shape}", [shape, shape], lambda c: lambda u, g: U.silu_glu(u, g, c))
for shape, dim in [((512, 64), -1), ((8, 16, 256), -1), ((128, 96), 0)]:
    _case(f"softmax-{shape}-dim{dim}", [shape], lambda c, d=dim: lambda x: U.softmax(x, d, None, c))
for shape_a, shape_b in [((16, 64, 32), (16, 64, 32)), ((4, 32, 48), (32, 48))]:
    _case(
        f"add-{shape_a}+{shape_b}", [shape_a, shape_b], lambda c: lambda a, b: U.add(a, b, 1.0, c)
    )


@pytest.mark.parametrize(
    "name,make,shapes", CONSTRAINED_CASES, ids=[c[0] for c in CONSTRAINED_CASES]
)
def test_separate_scales_make_everything_unit(name, make, shapes):
    out_std, grad_stds = run_op(make(None), shapes)
    assert_unit(out_std, what=f"{name} output")
    for i, g in enumerate(grad_stds):
        if name.startswith("add") and shapes[i] != shapes[0]:
            continue  # a broadcast input's gradient sums copies; checked separately
        assert_unit(g, what=f"{name} grad of input {i}")


@pytest.mark.parametrize(
    "name,make,shapes", CONSTRAINED_CASES, ids=[c[0] for c in CONSTRAINED_CASES]
)
def test_gmean_ties_forward_and_backward(name, make, shapes):
    out_std, grad_stds = run_op(make("gmean"), shapes)
    tied = [
        g for i, g in enumerate(grad_stds) if shapes[i] == shapes[0] or not name.startswith("add")
    ]
    product = out_std * math.prod(tied)
    assert abs(product - 1) <= PRODUCT_TOL, f"{name}: std(out) * prod std(grads) = {product:.3f}"


@pytest.mark.parametrize(
    "name,make,shapes", CONSTRAINED_CASES, ids=[c[0] for c in CONSTRAINED_CASES]
)
def test_to_output_scale_keeps_output_unit(name, make, shapes):
    out_std, _ = run_op(make("to_output_scale"), shapes)
    assert_unit(out_std, what=f"{name} output")


@pytest.mark.parametrize(
    "name,make,shapes", CONSTRAINED_CASES, ids=[c[0] for c in CONSTRAINED_CASES]
)
def test_to_grad_input_scale_keeps_first_grad_unit(name, make, shapes):
    _, grad_stds = run_op(make("to_grad_input_scale"), shapes)
    assert_unit(grad_stds[0], what=f"{name} grad of input 0")


@pytest.mark.parametrize("fan_in,fan_out", [(64, 256), (256, 64)])
def test_constrained_linear_is_not_unit_on_the_other_side(fan_in, fan_out):
    """Keeping the output unit puts the input gradient at sqrt(fan_out / fan_in), as ruled."""
    weight = torch.randn(fan_out, fan_in)
    _, (grad_std,) = run_op(
        lambda x: U.linear(x, weight, None, "to_output_scale"), [(2048, fan_in)]
    )
    expected = math.sqrt(fan_out / fan_in)
    assert abs(expected - 1) >= 0.5
    assert abs(grad_std / expected - 1) < 0.15
    out_std, (grad_std,) = run_op(lambda x: U.linear(x, weight, None, "gmean"), [(2048, fan_in)])
    assert abs(out_std / (fan_out / fan_in) ** -0.25 - 1) < 0.15
    assert abs(grad_std / (fan_out / fan_in) ** 0.25 - 1) < 0.15


def test_hmean_and_amean_lean_as_documented():
    weight = torch.randn(256, 64)  # output scale 1/8 ideal, grad-input scale 1/16 ideal
    _, (h_grad,) = run_op(lambda x: U.linear(x, weight, None, "hmean"), [(2048, 64)])
    _, (a_grad,) = run_op(lambda x: U.linear(x, weight, None, "amean"), [(2048, 64)])
    _, (g_grad,) = run_op(lambda x: U.linear(x, weight, None, "gmean"), [(2048, 64)])
    assert h_grad < g_grad < a_grad


@pytest.mark.parametrize("shape", [(4096, 64), (64, 32, 128), (3, 1024, 96)])
def test_linear_weight_and_bias_grads_are_unit(shape):
    fan_in = shape[-1]
    weight = torch.randn(80, fan_in, requires_grad=True)
    bias = torch.zeros(80, requires_grad=True)
    x = torch.randn(*shape, requires_grad=True)
    out = U.linear(x, weight, bias, None)
    out.backward(torch.randn_like(out))
    assert_unit(weight.grad.std().item(), 0.25, "weight grad")
    assert_unit(bias.grad.std().item(), 0.25, "bias grad")


@pytest.mark.parametrize("shape", [(2048, 64), (8, 128, 256), (2, 1024, 32)])
def test_layer_norm_is_unit_with_unit_param_grads(shape):
    hidden = shape[-1]
    weight = torch.ones(hidden, requires_grad=True)
    bias = torch.zeros(hidden, requires_grad=True)
    out_std, (grad_std,) = run_op(lambda x: U.layer_norm(x, (hidden,), weight, bias), [shape])
    assert_unit(out_std, what="layer_norm output")
    assert_unit(grad_std, what="layer_norm input grad")
    assert_unit(weight.grad.std().item(), 0.25, "layer_norm weight grad")
    assert_unit(bias.grad.std().item(), 0.25, "layer_norm bias grad")


@pytest.mark.parametrize("vocab,lookups", [(65, (32, 64)), (1000, (4, 4096)), (50, (2, 16))])
def test_embedding_is_unit_with_unit_weight_grad(vocab, lookups):
    weight = torch.randn(vocab, 96, requires_grad=True)
    ids = torch.randint(0, vocab, lookups, generator=torch.Generator().manual_seed(3))
    out = U.embedding(ids, weight)
    out.backward(torch.randn_like(out))
    assert_unit(out.std().item(), what="embedding output")
    # Rows looked up only a few times give a noisy std; the rule is about the average.
    assert_unit(weight.grad.std().item(), 0.25, "embedding weight grad")


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("shape", [(4096, 64), (8, 64, 128)])
def test_dropout_is_unit(p, shape):
    out_std, (grad_std,) = run_op(lambda x: U.dropout(x, p), [shape])
    assert_unit(out_std, what="dropout output")
    assert_unit(grad_std, what="dropout grad")
    x = torch.randn(*shape)
    assert torch.equal(U.dropout(x, p, training=False), x)


@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0, 3.0])
def test_residual_pair_is_unit_and_branch_sees_unit_grads(tau):
    torch.manual_seed(0)
    x = torch.randn(64, 64, 128, requires_grad=True)
    weight = torch.randn(128, 128, requires_grad=True)
    branch_in, skip = U.residual_split(x, tau)
    branch_out = U.linear(branch_in, weight, None, None)
    branch_out.retain_grad()
    out = U.residual_add(branch_out, skip, tau)
    out.backward(torch.randn_like(out))
    assert_unit(out.std().item(), what="residual output")
    assert_unit(x.grad.std().item(), what="residual input grad")
    assert_unit(branch_out.grad.std().item(), what="branch output grad")
    assert_unit(weight.grad.std().item(), 0.25, "branch weight grad")


def test_residual_gradient_is_the_true_gradient_of_the_weighted_sum():
    """Up to the branch's own (linear) grad scale, x's gradient is that of a*f(x) + b*x."""
    tau = 0.3
    a, b = tau / math.sqrt(1 + tau**2), 1 / math.sqrt(1 + tau**2)
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 16, dtype=torch.float64)
    branch, skip = U.residual_split(x, tau)
    U.residual_add(branch @ w, skip, tau).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    (a * (x_ref @ w) + b * x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("tau", [1e-200, 1e-8, 1.0, 1e8, 1e160, 1e300])
def test_residual_weights_stay_finite_and_unit_for_extreme_tau(tau):
    """The branch and skip weights are tau and 1 over sqrt(1 + tau**2), their squares summing
    to 1, where tau**2 alone under- or overflows (float64 reference from the ratio form)."""
    branch, skip = unit_ops.residual_tau_weights(tau)
    assert branch**2 + skip**2 == pytest.approx(1.0, rel=1e-12)
    assert branch / skip == pytest.approx(tau, rel=1e-12)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seq", [64, 256, 1024])
def test_attention_is_unit(is_causal, seq):
    """At torch's logit scale 1/sqrt(head_dim) (the op's default is u-μP's 1/head_dim)."""
    heads = 2 if seq == 1024 else 4
    out_std, (q, k, v) = run_op(
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                       scale=32**-0.5),
        [(2, heads, seq, 32)] * 3,
    )
    assert_unit(out_std, what="attention output")
    for name, g in zip("qkv", (q, k, v)):
        assert_unit(g, what=f"attention grad {name}")


def test_attention_with_boolean_mask_and_dropout_is_unit():
    seq = 128
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    torch.manual_seed(0)
    out_std, (_, _, v) = run_op(
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2),
        [(4, 4, seq, 32)] * 3,
    )
    assert_unit(out_std, what="masked attention output")
    assert_unit(v, what="masked attention grad v")


@pytest.mark.parametrize("logit_std", [0.5, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("masking", ["none", "causal", "mask"])
def test_attention_is_unit_for_any_logit_std(logit_std, masking):
    """With `scale` set, the logits' std is scale * sqrt(head_dim); the row scale follows it
    (above std 1 from the quadrature: the closed form is off by x1.5 at 1.5 and x4 at 2)."""
    seq, head_dim = 64, 32
    mask = torch.rand(seq, seq, generator=torch.Generator().manual_seed(3)) < 0.5
    mask |= torch.eye(seq, dtype=torch.bool)
    arguments = {"none": {}, "causal": {"is_causal": True}, "mask": {"attn_mask": mask}}[masking]
    scale = logit_std / head_dim**0.5
    out_std, (_, _, v) = run_op(
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, scale=scale, **arguments),
        [(8, 4, seq, head_dim)] * 3,
    )
    assert_unit(out_std, what="attention output")
    assert_unit(v, what="attention grad v")


def test_softmax_square_sum_closed_form_is_within_5_percent_up_to_logit_std_1():
    from ipu_unit_scaling.ops.activation_ops import expected_softmax_square_sum
    from ipu_unit_scaling.ops.softmax_moments import softmax_moments

    keys = np.arange(1, 2049, dtype=np.float64)
    for logit_std in (0.25, 0.5, 0.75, 1.0):
        exact = softmax_moments(2048, logit_std)[0]
        ratio = expected_softmax_square_sum(keys, logit_std) / exact
        assert 0.95 <= ratio.min() and ratio.max() <= 1.05, logit_std
    # Above 1 the function returns the quadrature's values, for numbers and tensors alike.
    exact = softmax_moments(100, 2.0)[0]
    assert expected_softmax_square_sum(37.0, 2.0) == exact[36]
    counts = torch.tensor([[1.0], [37.0], [100.0]])
    np.testing.assert_allclose(expected_softmax_square_sum(counts, 2.0, 100).flatten().numpy(),
                               exact[[0, 36, 99]], rtol=1e-6)


def test_attention_output_matches_torch_up_to_row_scale():
    q, k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    ours = U.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8**-0.5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ratio = ours / ref
    # One positive factor per query row, the same across batch, heads and features.
    torch.testing.assert_close(ratio, ratio[:1, :1, :, :1].expand_as(ratio))
    assert (ratio > 0).all()


@pytest.mark.parametrize("masking", ["none", "causal", "mask"])
def test_float64_attention_row_scales_stay_float64(masking):
    """A float64 model's attention is float64 end to end: the output and the value gradient are
    torch's float64 attention times row scales computed in float64 from the key counts. The
    tolerance is float64's unit roundoff 2**-53 = 1.1e-16 times a bound of 1e4 on the ops in
    between (the closed form's exp/pow, softmax over 16 keys, 8-term dot products): 1e-12. Row
    scales counted in float32 (as before) are off by float32's 2**-24 = 6e-8 relative and fail."""
    from ipu_unit_scaling.ops.activation_ops import expected_softmax_square_sum

    seq, head_dim = 16, 8
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, seq, head_dim, generator=gen, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 2, seq, head_dim, generator=gen, dtype=torch.float64)
    mask = torch.rand(seq, seq, generator=gen) < 0.5
    mask |= torch.eye(seq, dtype=torch.bool)
    arguments = {"none": {}, "causal": {"is_causal": True}, "mask": {"attn_mask": mask}}[masking]
    visible = {"none": torch.full((seq, 1), float(seq), dtype=torch.float64),
               "causal": torch.arange(1.0, seq + 1, dtype=torch.float64).unsqueeze(-1),
               "mask": mask.sum(-1, keepdim=True).to(torch.float64)}[masking]
    row_scale = expected_softmax_square_sum(visible) ** -0.5
    ours = U.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, **arguments)
    assert ours.dtype == torch.float64
    (ours_grad_v,) = torch.autograd.grad(ours, v, grad)
    ref = F.scaled_dot_product_attention(q, k, v, **arguments)
    (ref_grad_v,) = torch.autograd.grad(ref, v, grad * row_scale)
    torch.testing.assert_close(ours, ref * row_scale, rtol=1e-12, atol=1e-12)
    # (the value gradient has its own backward scale: compare up to one factor)
    factor = (ours_grad_v / ref_grad_v).flatten()[0]
    torch.testing.assert_close(ours_grad_v, ref_grad_v * factor, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows,classes", [(4096, 65), (512, 1000), (2048, 17)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_value_matches_torch_and_grad_is_unit(rows, classes, reduction):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, classes, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, classes, (rows,), generator=gen)
    loss = U.cross_entropy(logits, target, reduction=reduction)
    ref = F.cross_entropy(logits.detach(), target, reduction=reduction)
    assert abs(loss.item() - ref.item()) <= 1e-6 * max(1.0, abs(ref.item()))
    loss.backward()
    assert_unit(logits.grad.std().item(), what="cross_entropy input grad")


def test_cross_entropy_over_sequence_dimension_and_ignore_index():
    logits = torch.randn(4, 30, 64, requires_grad=True)  # (batch, classes, seq)
    target = torch.randint(0, 30, (4, 64))
    target[0, :8] = -100
    loss = U.cross_entropy(logits, target)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(4096,), (64, 32, 16)])
def test_mse_loss_value_matches_torch_and_grads_are_unit(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    t = torch.randn(*shape, generator=gen, requires_grad=True)
    loss = U.mse_loss(x, t)
    torch.testing.assert_close(loss, F.mse_loss(x, t))
    loss.backward()
    assert_unit(x.grad.std().item(), what="mse input grad")
    assert_unit(t.grad.std().item(), what="mse target grad")


def test_scale_primitives_scale_one_direction_each():
    x = torch.randn(10, requires_grad=True)
    scale_fwd(x, 3.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(10))
    x.grad = None
    y = scale_bwd(x, 3.0)
    torch.testing.assert_close(y, x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((10,), 3.0))
    x.grad = None
    y = scale(x, 2.0, 5.0)
    torch.testing.assert_close(y, 2 * x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((10,), 5.0))


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda: U.embedding(torch.tensor([1]), torch.randn(3, 4), sparse=True), "sparse"),
        (
            lambda: U.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), weight=torch.ones(3)),
            "weight",
        ),
        (
            lambda: U.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), reduction="avg"),
            "reduction",
        ),
        (lambda: U.relu(torch.randn(3), inplace=True), "inplace"),
        (lambda: U.dropout(torch.randn(3), p=1.0), "p="),
        (lambda: U.linear(torch.randn(2, 4), torch.randn(3, 4), constraint="median"), "constraint"),
        (lambda: U.residual_split(torch.randn(3), tau=0.0), "tau"),
        (lambda: U.residual_split(torch.randn(3), tau=math.inf), "tau"),
        (lambda: U.add(torch.randn(3), torch.randn(3), alpha=0), "alpha"),
        (
            lambda: U.scaled_dot_product_attention(
                *(torch.randn(1, 1, 4, 8) for _ in range(3)), attn_mask=torch.zeros(4, 4)
            ),
            "attn_mask",
        ),
        (
            lambda: U.scaled_dot_product_attention(
                torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8),
                enable_gqa=True,
            ),
            "enable_gqa",
        ),
        (lambda: U.mse_loss(torch.randn(3), torch.randn(4)), "shape"),
    ],
)
def test_unsupported_arguments_raise_naming_them(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_ops_compute_the_same_function_as_torch_in_the_forward_pass():
    x = torch.randn(8, 16, dtype=torch.float64)
    w = torch.randn(12, 16, dtype=torch.float64)
    b = torch.randn(12, dtype=torch.float64)
    # Up to the documented output scale, the value is torch's.
    out = U.linear(x, w, b, "to_output_scale")
    torch.testing.assert_close(out, F.linear(x, w, b) / 4)
    torch.testing.assert_close(U.layer_norm(x, (16,)), F.layer_norm(x, (16,)))
    ratio = U.gelu(x, constraint=None) / F.gelu(x)
    torch.testing.assert_close(ratio, ratio.flatten()[:1].expand_as(ratio))
