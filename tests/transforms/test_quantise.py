"""simulate_fp8 on a small plain-torch GPT at default init."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ipu_unit_scaling.fp8 import FP8Config, FP8Linear, fp8_stats
from ipu_unit_scaling.fp8.attention import FP8AttentionFn
from ipu_unit_scaling.transforms import simulate_fp8

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.attention_fn = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = self.attention_fn(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 64, depth: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.Sequential(*(Block(width, 4) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        return self.head(self.norm(self.blocks(x)))


def flushed_gradient_fraction(config: FP8Config) -> float:
    torch.manual_seed(0)
    model = simulate_fp8(TinyGPT(), config)
    tokens = torch.randint(0, 512, (8, 33))
    with fp8_stats() as stats:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))  # mean
        loss.backward()
    records = stats.select(".grad_output")
    assert len(records) == 2 * 4 + 1  # every linear's output gradient was cast
    return stats.pooled_flushed_fraction(records)


def test_static_scaling_flushes_small_gradients_and_amax_does_not():
    # Mean cross-entropy over 256 tokens and 512 classes: logit gradients ~ 1/(256*512) = 2**-17,
    # and the linear layers' output gradients have medians between 2**-17 and 2**-12.5, at the
    # bottom of F152 (smallest normal 2**-15, smallest subnormal 2**-17).
    static = flushed_gradient_fraction(FP8Config(scaling="static"))
    amax = flushed_gradient_fraction(FP8Config(scaling="amax"))
    assert static > 0.05, static
    assert amax < 1e-3, amax
    assert amax < static / 50


def test_simulate_fp8_swaps_in_place_and_keeps_parameters():
    model = TinyGPT()
    params = dict(model.named_parameters())
    out = simulate_fp8(model, FP8Config())
    assert out is model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 9 and all(isinstance(m, FP8Linear) for m in linears.values())
    assert linears["blocks.0.qkv"].site == "blocks.0.qkv"
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    assert not isinstance(model.blocks[0].attention_fn, FP8AttentionFn)  # attention off
    simulate_fp8(model, FP8Config())  # idempotent
    assert isinstance(model.head, FP8Linear)
    bare = simulate_fp8(nn.Linear(4, 4), FP8Config())
    assert isinstance(bare, FP8Linear)


def test_simulate_fp8_copies_without_a_config_and_converts_in_place_with_one():
    """unit-scaling's call returns a copy and leaves the model as it was; with an FP8Config the
    model itself is converted and returned."""
    model = nn.Sequential(nn.Linear(4, 4))
    copied = simulate_fp8(model)
    assert copied is not model and type(model[0]) is nn.Linear
    assert copied[0].weight is not model[0].weight
    assert torch.equal(copied[0].weight, model[0].weight)
    assert simulate_fp8(model, FP8Config()) is model
    assert isinstance(model[0], FP8Linear)


def test_simulate_fp8_attention_option():
    torch.manual_seed(1)
    model = simulate_fp8(TinyGPT(depth=1), FP8Config(attention=True))
    assert isinstance(model.blocks[0].attention_fn, FP8AttentionFn)
    with fp8_stats() as stats:
        model(torch.randint(0, 512, (2, 16))).sum().backward()
    sites = {r.site for r in stats.records}
    assert {"blocks.0.scores.left", "blocks.0.values.right",
            "blocks.0.values.grad_output"} <= sites
    # Other linear layers' matmuls were not also routed through attention's casts.
    assert not any(s.startswith("blocks.0.matmul") for s in sites)


def test_unit_scaled_linear_keeps_its_scales():
    """With operands already on the FP8 grids, static FP8 is exact: it must equal U.linear."""
    from ipu_unit_scaling import functional as U
    from ipu_unit_scaling import modules as uu
    from ipu_unit_scaling.fp8 import F143, F152, FP8UnitScaledLinear, quantise

    g = torch.Generator().manual_seed(5)
    layer = uu.Linear(32, 24, bias=True, constraint=None)
    with torch.no_grad():
        layer.weight.copy_(quantise(torch.randn(24, 32, generator=g), F143))
        layer.bias.copy_(torch.randn(24, generator=g))
    x0 = quantise(torch.randn(5, 7, 32, generator=g), F143)
    grad_y = quantise(torch.randn(5, 7, 24, generator=g), F152)

    x = x0.clone().requires_grad_()
    expected = U.linear(x, layer.weight, layer.bias, constraint=None)
    expected.backward(grad_y)
    expected_grads = [x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
    layer.zero_grad()

    model = simulate_fp8(nn.Sequential(layer), FP8Config(scaling="static"))
    assert isinstance(model[0], FP8UnitScaledLinear) and model[0].constraint is None
    x = x0.clone().requires_grad_()
    y = model(x)
    y.backward(grad_y)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip([x.grad, layer.weight.grad, layer.bias.grad], expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_unit_scaled_decoder_with_fp8_attention():
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8UnitScaledLinear

    torch.manual_seed(2)
    model = uu.GPT(vocab_size=64, hidden_size=32, depth=1, heads=2, seq_len=16)
    simulate_fp8(model, FP8Config(scaling="static", attention=True))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, FP8UnitScaledLinear) for m in linears)
    tokens = torch.randint(0, 64, (4, 17))
    with fp8_stats() as stats:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    assert torch.isfinite(loss)
    sites = {r.site for r in stats.records}
    assert any(s.endswith(".scores.left") for s in sites)
    assert any(s.endswith(".values.grad_output") for s in sites)
