"""FP8 linear, matmul and attention against float64 references with the same quantisation."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ipu_unit_scaling.fp8 import (
    FP8Config,
    FP8Linear,
    fp8_attention,
    fp8_linear,
    fp8_matmul,
    fp8_stats,
)

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

ML_DTYPES = {"F143": ml_dtypes.float8_e4m3fnuz, "F152": ml_dtypes.float8_e5m2fnuz,
             "E4M3FN": ml_dtypes.float8_e4m3fn, "E5M2": ml_dtypes.float8_e5m2}
MAXES = {"F143": 240.0, "F152": 57344.0, "E4M3FN": 448.0, "E5M2": 57344.0}


def oracle_quantise(x: torch.Tensor, fmt: str, margin: int, static: bool) -> torch.Tensor:
    """Independent AMAX quantisation: numpy log2 for the scale, ml_dtypes for the rounding."""
    a = x.detach().float().numpy().astype(np.float64)
    amax = np.abs(a).max()
    s = 0 if static else int(np.clip(np.floor(np.log2(MAXES[fmt] / amax)) - margin, -31, 31))
    scaled = np.clip(a * 2.0**s, -MAXES[fmt], MAXES[fmt]).astype(np.float32)
    q = scaled.astype(ML_DTYPES[fmt]).astype(np.float64) * 2.0**-s
    return torch.from_numpy(q)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = (actual.double() - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), err


@pytest.mark.parametrize("config", [FP8Config(), FP8Config(activation_format="E4M3FN",
                                    weight_format="E4M3FN", gradient_format="E5M2",
                                    gradient_margin=1)], ids=["ipu", "ocp"])
def test_fp8_linear_matches_float64_reference(config):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 24, generator=g) * 0.3).requires_grad_()
    w = (torch.randn(40, 24, generator=g) * 0.05).requires_grad_()
    b = torch.randn(40, generator=g).requires_grad_()
    grad_y = torch.randn(3, 7, 40, generator=g) * 1e-3
    y = fp8_linear(x, w, b, config)
    y.backward(grad_y)

    xq = oracle_quantise(x, config.activation_format, config.activation_margin, False)
    wq = oracle_quantise(w, config.weight_format, config.weight_margin, False)
    gq = oracle_quantise(grad_y, config.gradient_format, config.gradient_margin, False)
    assert_rel_close(y, xq @ wq.T + b.detach().double(), 1e-5)
    assert_rel_close(x.grad, gq @ wq, 1e-5)
    assert_rel_close(w.grad, gq.reshape(-1, 40).T @ xq.reshape(-1, 24), 1e-5)
    assert_rel_close(b.grad, grad_y.double().reshape(-1, 40).sum(0), 1e-5)
    # And FP8 really happened: the result is not the float32 one.
    assert not torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=0)


def fp8_error_bound(a: torch.Tensor, b: torch.Tensor, mbits_a: int, mbits_b: int,
                    sub_a: float, sub_b: float) -> torch.Tensor:
    """Elementwise bound on |q(a) @ q(b) - a @ b| for round-to-nearest FP8 casts."""
    ea = torch.maximum(a.abs() * 2.0 ** -(mbits_a + 1), torch.full_like(a, sub_a / 2))
    eb = torch.maximum(b.abs() * 2.0 ** -(mbits_b + 1), torch.full_like(b, sub_b / 2))
    return ea @ b.abs() + a.abs() @ eb + ea @ eb


def test_static_mode_on_unit_scaled_tensors_is_within_fp8_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g).requires_grad_()
    w = torch.randn(48, 32, generator=g).requires_grad_()
    grad_y = torch.randn(64, 48, generator=g)
    y = fp8_linear(x, w, None, FP8Config(scaling="static"))
    y.backward(grad_y)
    xd, wd, gd = x.detach().double(), w.detach().double(), grad_y.double()
    f143_sub, f152_sub = 2.0**-10, 2.0**-17
    slack = 1e-5  # float32 accumulation
    bound = fp8_error_bound(xd, wd.T, 3, 3, f143_sub, f143_sub)
    assert torch.all((y.double() - xd @ wd.T).abs() <= bound + slack)
    bound = fp8_error_bound(gd, wd, 2, 3, f152_sub, f143_sub)
    assert torch.all((x.grad.double() - gd @ wd).abs() <= bound + slack)
    bound = fp8_error_bound(gd.T, xd, 2, 3, f152_sub, f143_sub)
    assert torch.all((w.grad.double() - gd.T @ xd).abs() <= bound + slack)
    rel = (y.double() - xd @ wd.T).norm() / (xd @ wd.T).norm()
    assert 1e-3 < rel < 0.05


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fnuz") or not hasattr(torch, "_scaled_mm"),
                    reason="needs torch float8 dtypes and torch._scaled_mm")
@pytest.mark.parametrize("fmts", [("F143", "F152"), ("E4M3FN", "E5M2")])
def test_scaled_mm_path_equals_dequantised_path(fmts):
    config = FP8Config(activation_format=fmts[0], weight_format=fmts[0],
                       gradient_format=fmts[1])
    g = torch.Generator().manual_seed(2)
    x0, w0 = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g) * 0.1
    grad_y = torch.randn(32, 48, generator=g)
    results = []
    for use_scaled_mm in (False, True):
        try:
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = fp8_linear(x, w, None, config, use_scaled_mm=use_scaled_mm)
            y.backward(grad_y)
        except (RuntimeError, NotImplementedError) as error:
            pytest.skip(f"torch._scaled_mm does not run here: {error}")
        results.append((y, x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())


def test_fp8_linear_module_shares_and_converts():
    linear = torch.nn.Linear(16, 8)
    fp8 = FP8Linear.from_linear(linear, FP8Config(), site="proj")
    assert fp8.weight is linear.weight and fp8.bias is linear.bias
    assert fp8.state_dict().keys() == linear.state_dict().keys()
    x = torch.randn(4, 16, dtype=torch.float16)
    with fp8_stats() as stats:
        y = FP8Linear(16, 8, dtype=torch.float16)(x)
    assert y.dtype == torch.float16
    assert [r.site for r in stats.records] == ["linear.input", "linear.weight"]
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.randn(2, 5), torch.randn(3, 4))


def test_fp8_matmul_broadcast_gradients_match_reference():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 3, 5, 8, generator=g).requires_grad_()
    b = torch.randn(1, 3, 8, 6, generator=g).requires_grad_()
    grad = torch.randn(2, 3, 5, 6, generator=g)
    out = fp8_matmul(a, b)
    out.backward(grad)
    aq, bq = oracle_quantise(a, "F143", 0, False), oracle_quantise(b, "F143", 0, False)
    gq = oracle_quantise(grad, "F152", 3, False)
    assert_rel_close(out, aq @ bq, 1e-5)
    assert_rel_close(a.grad, gq @ bq.transpose(-1, -2), 1e-5)
    assert_rel_close(b.grad, (aq.transpose(-1, -2) @ gq).sum(0, keepdim=True), 1e-5)


def test_fp8_attention_replaces_sdpa_with_quantised_matmuls():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    q.requires_grad_()
    with fp8_stats() as stats, fp8_attention(FP8Config()):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()
    sites = [r.site for r in stats.records]
    assert sites[:4] == ["attention.scores.left", "attention.scores.right",
                         "attention.values.left", "attention.values.right"]
    # Reference: float64 softmax attention on the same quantised operands.
    qq, kq = oracle_quantise(q, "F143", 0, False), oracle_quantise(k, "F143", 0, False)
    scores = (qq @ kq.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -math.inf)
    probs = torch.softmax(scores, -1)
    expected = oracle_quantise(probs, "F143", 0, False) @ oracle_quantise(v, "F143", 0, False)
    assert_rel_close(out, expected, 1e-4)  # float32 softmax vs float64
    assert q.grad is not None and torch.isfinite(q.grad).all()
