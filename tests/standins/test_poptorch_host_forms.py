"""``F.scaled_dot_product_attention`` as PopTorch receives it: torch's math form, whose ops
PopTorch has handlers for, never the host's CPU flash kernel (one op it has no handler for)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import torch_before

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch._host_forms import math_attention
from ipu_standins.poptorch_trace import trace_like_poptorch

# Two matmuls of at most 16 terms and a softmax over at most 8 keys, in float32: each output
# is a few tens of roundings from the exact value, on either side of the comparison.
TOLERANCE = 64 * torch.finfo(torch.float32).eps


class _Attention(torch.nn.Module):
    def __init__(self, **kwargs: object):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                *mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, *mask, **self.kwargs)  # type: ignore


def _qkv(seed: int = 0, kv_heads: int = 2) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, 8, 16, generator=g), torch.randn(2, kv_heads, 8, 16, generator=g),
            torch.randn(2, kv_heads, 8, 16, generator=g))


_NEEDS_2_1 = pytest.mark.skipif(torch_before(2, 1), reason="sdpa's scale came with torch 2.1")


@pytest.mark.parametrize("kwargs,mask", [({}, None), ({"is_causal": True}, None),
                                         pytest.param({"scale": 0.3}, None, marks=_NEEDS_2_1),
                                         ({}, "bool"), ({}, "float")],
                         ids=["plain", "causal", "scale", "bool-mask", "float-mask"])
def test_sdpa_traces_as_torchs_math_form_with_its_values(kwargs, mask):
    g = torch.Generator().manual_seed(1)
    masks = {None: (), "bool": (torch.rand(8, 8, generator=g) > 0.3,),
             "float": (torch.randn(8, 8, generator=g),)}[mask]
    inputs = (*_qkv(), *masks)
    module = _Attention(**kwargs)
    trace = trace_like_poptorch(module, *inputs)
    ops = trace.ops()
    assert not any("flash" in op or "scaled_dot_product" in op for op in ops), ops
    assert "aten::_softmax" in ops and "aten::bmm" in ops, ops
    assert trace.report.ok, trace.report
    torch.testing.assert_close(trace(*inputs), module(*inputs), rtol=TOLERANCE, atol=TOLERANCE)


def test_sdpa_trains_through_the_standin_with_eager_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv())
    module = _Attention(is_causal=True)
    out = poptorch.inferenceModel(module)(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(out, module(q, k, v), rtol=TOLERANCE, atol=TOLERANCE)
    traced = trace_like_poptorch(module, q, k, v)
    grads = torch.autograd.grad(traced(q, k, v).square().sum(), (q, k, v))
    eager = torch.autograd.grad(module(q, k, v).square().sum(), (q, k, v))
    for got, want in zip(grads, eager):
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE * 16)


def test_math_attention_repeats_key_heads_for_grouped_queries():
    q, k, v = _qkv(kv_heads=1)
    got = math_attention(q, k, v, enable_gqa=True)
    want = math_attention(q, k.expand_as(q), v.expand_as(q))
    assert torch.equal(got, want)


def test_math_attention_refuses_a_mask_with_is_causal_as_torch_does():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="attn_mask should not be set"):
        math_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True)


def test_math_attention_scales_the_logits_as_asked():
    q, k, v = _qkv()
    plain = math_attention(q, k, v)
    assert torch.allclose(plain, math_attention(q, k, v, scale=1 / math.sqrt(16)),
                          rtol=TOLERANCE, atol=TOLERANCE)
    assert not torch.allclose(plain, math_attention(q, k, v, scale=1.0))
