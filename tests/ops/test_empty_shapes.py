"""Zero-size dimensions: the unit-scaled ops return what torch returns, and FP8 decodes only
to floating-point dtypes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ipu_unit_scaling.functional as U
from ipu_unit_scaling.fp8 import cast_from_fp8, cast_to_fp8


@pytest.mark.parametrize("x_shape, w_shape", [((0, 4), (3, 4)), ((2, 0), (3, 0)),
                                              ((2, 4), (0, 4)), ((5, 0, 4), (3, 4))])
def test_linear_on_empty_dimensions_matches_torch(x_shape, w_shape):
    x = torch.randn(x_shape, requires_grad=True)
    w = torch.randn(w_shape, requires_grad=True)
    out = U.linear(x, w)
    expected = F.linear(x, w)
    assert out.shape == expected.shape
    assert torch.equal(out, expected)  # empty, or all zeros for an empty sum
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("left, right", [((2, 0), (0, 3)), ((0, 2), (2, 3)), ((2, 2), (2, 0)),
                                         ((0, 2, 3), (3, 4)), ((3,), (3, 0))])
def test_matmul_on_empty_dimensions_matches_torch(left, right):
    a, b = torch.randn(left), torch.randn(right)
    out = U.matmul(a, b)
    assert torch.equal(out, torch.matmul(a, b))


@pytest.mark.parametrize("q_shape, k_shape, causal", [
    ((1, 0, 4), (1, 0, 4), True), ((1, 2, 4), (1, 3, 4), False), ((1, 2, 0), (1, 2, 0), False),
    ((0, 2, 4), (0, 2, 4), True)])
def test_attention_on_empty_dimensions_matches_torch_shape(q_shape, k_shape, causal):
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    out = U.scaled_dot_product_attention(q, k, k, is_causal=causal)
    expected = F.scaled_dot_product_attention(q, k, k, is_causal=causal)
    assert out.shape == expected.shape
    assert torch.isfinite(out).all()


def test_fp8_values_do_not_decode_to_integers():
    cast = cast_to_fp8(torch.randn(8), "F143")
    with pytest.raises(TypeError, match="floating-point"):
        cast_from_fp8(cast, torch.int32)
