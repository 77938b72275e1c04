"""unit_scale(model): conversion of plain models, unit scales at initialisation, training."""
from __future__ import annotations

import warnings
from typing import List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ipu_unit_scaling as uu
from ipu_unit_scaling import functional as U
from ipu_unit_scaling.analysis import ScaleRecord, record_scales
from ipu_unit_scaling.models import GPTConfig, build_gpt
from ipu_unit_scaling.transforms import (
    UnitMultiheadAttention,
    UnitScaleWarning,
    unit_scale,
    unit_scale_with_report,
)

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


TINY = GPTConfig(vocab_size=65, seq_len=32, depth=2, hidden_size=64, heads=2, unit_scaled=False)


def fraction_unit(records: List[ScaleRecord]) -> float:
    """Fraction of activation and gradient tensors with std in [0.5, 2]."""
    chosen = [r for r in records if r.role in ("activation", "gradient")]
    assert len(chosen) > 10
    return sum(0.5 <= r.std <= 2 for r in chosen) / len(chosen)


def tokens(batch: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (batch, TINY.seq_len), generator=generator)
    labels = torch.randint(0, TINY.vocab_size, (batch, TINY.seq_len), generator=generator)
    return ids, labels


def plain_gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_gpt(TINY)


# ---------------------------------------------------------------- the example GPT


def test_gpt_is_unit_scaled_after_conversion_and_not_before() -> None:
    model = plain_gpt()
    ids, labels = tokens()
    converted, report = unit_scale_with_report(model, (ids, labels))
    assert not report.unconverted and not report.untraceable
    assert len(report.residuals) == 2 * TINY.depth

    before = record_scales(model, ids, labels)
    after = record_scales(converted, ids, labels)
    assert fraction_unit(after) >= 0.9
    assert fraction_unit(before) < 0.5
    tiny_gradients = [r for r in before if r.role == "gradient" and r.std < 2**-10]
    gradients = [r for r in before if r.role == "gradient"]
    assert len(tiny_gradients) >= len(gradients) / 2
    assert not [r for r in after if r.role == "gradient" and r.std < 2**-10]


def test_gpt_conversion_swaps_layers_and_functions() -> None:
    ids, labels = tokens()
    converted = unit_scale(plain_gpt(), (ids, labels))
    kinds = {type(m) for m in converted.modules()}
    assert {uu.Linear, uu.LayerNorm, uu.Embedding} <= kinds
    assert nn.Linear not in kinds and nn.LayerNorm not in kinds
    code = converted.graph_module.code
    for name in ("unit_residual_branch", "unit_residual_add", "unit_gelu",
                 "unit_scaled_dot_product_attention", "unit_cross_entropy", "unit_add"):
        assert name in code
    # The attention branch gets the smaller tau.
    assert "unit_residual_branch(dropout, 0.01)" in code.replace(" ", "").replace(",0.01", ", 0.01")


def test_residual_join_is_the_weighted_sum() -> None:
    """The converted residual computes a * branch + b * skip with a**2 + b**2 = 1."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: Tensor) -> Tensor:
            return x + self.fc(x)

    x = torch.randn(32, 16)
    converted, report = unit_scale_with_report(Block(), (x,), mlp_tau=0.5)
    assert len(report.residuals) == 1
    fc = converted.graph_module.get_submodule("inner.fc")
    branch = U.linear(x, fc.weight, fc.bias)
    a, b = 0.5 / (1.25**0.5), 1 / (1.25**0.5)
    torch.testing.assert_close(converted(x), a * branch + b * x)


def test_original_untouched_and_conversion_deterministic() -> None:
    model = plain_gpt()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    ids, labels = tokens()
    rng_before = torch.random.get_rng_state()
    first = unit_scale(model, (ids, labels))
    second = unit_scale(model, (ids, labels))
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert [type(m) for m in model.modules()] == kinds
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert torch.equal(first(ids, labels), second(ids, labels))
    assert torch.equal(first(ids, labels), first(ids, labels))
    # A different seed gives different weights.
    third = unit_scale(model, (ids, labels), seed=1)
    assert not torch.equal(first(ids, labels), third(ids, labels))


def test_specialised_arguments_are_guarded() -> None:
    ids, labels = tokens()
    converted = unit_scale(plain_gpt(), (ids, labels))
    with pytest.raises(ValueError, match="specialised"):
        converted(ids, labels, return_logits=True)


# ---------------------------------------------------------------- other models


def test_transformer_encoder_stack() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, 128, dropout=0.1, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(4, 16, 64)
    converted, report = unit_scale_with_report(model, (x,))
    assert not report.unconverted
    assert len(report.residuals) == 4
    assert sum(isinstance(m, UnitMultiheadAttention) for m in converted.modules()) == 2
    assert not any(type(m) in (nn.Linear, nn.LayerNorm, nn.Dropout) for m in converted.modules())
    converted.eval()
    assert fraction_unit(record_scales(converted, x)) >= 0.9
    assert fraction_unit(record_scales(model.eval(), x)) < 0.9


class PositionalEmbedder(nn.Module):
    """Builds positions and a scale from its input's traced length and device."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 16)
        self.positions = nn.Embedding(8, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        hidden = self.tokens(ids) + self.positions(positions)
        return self.fc(hidden) * torch.full((ids.shape[-1], 1), 2.0, device=ids.device)


def test_tensor_factories_with_traced_arguments() -> None:
    """`torch.arange(x.shape[-1], device=x.device)` traces (torch 2.0.1 rejects the proxies)."""
    originals = (torch.arange, torch.full)
    model = PositionalEmbedder()
    ids = torch.randint(0, 10, (3, 8))
    converted, report = unit_scale_with_report(model, (ids,))
    assert (torch.arange, torch.full) == originals
    assert not report.untraceable and "add" in report.converted
    code = converted.graph_module.code
    assert "torch.arange(" in code and "torch.full(" in code
    # Positions follow the input length at run time: every position only sees its own token,
    # so a shorter sequence gives the longer one's prefix.
    shorter = converted(ids[:, :5])
    assert shorter.shape == (3, 5, 16)
    torch.testing.assert_close(shorter, converted(ids)[:, :5])
    tokens = converted.graph_module.get_submodule("inner.tokens")
    assert isinstance(tokens, uu.Embedding)
    with pytest.warns(UnitScaleWarning, match="not traced"):
        unit_scale(plain_gpt())  # without inputs its tracing fails part-way
    assert (torch.arange, torch.full) == originals


class SkipMLP(nn.Module):
    """An MLP classifier with skip connections and its loss inside."""

    def __init__(self, inputs: int = 32, width: int = 64, blocks: int = 3, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.ReLU(),
                          nn.Linear(2 * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        logits = self.head(hidden)
        return logits if labels is None else F.cross_entropy(logits, labels)


def test_mlp_with_skip_connections() -> None:
    torch.manual_seed(0)
    model = SkipMLP()
    x, labels = torch.randn(256, 32), torch.randint(0, 10, (256,))
    converted, report = unit_scale_with_report(model, (x, labels))
    assert len(report.residuals) == 3 and not report.unconverted
    assert "unit_cross_entropy" in converted.graph_module.code
    assert fraction_unit(record_scales(converted, x, labels)) >= 0.9
    assert fraction_unit(record_scales(model, x, labels)) < 0.5


def test_gpt2_from_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    if not transformers.utils.is_torch_available():
        # transformers 5 turns its PyTorch models off below torch 2.6 (the SDK's torch is 2.0.1).
        pytest.skip(f"transformers {transformers.__version__} has no PyTorch GPT-2 for torch "
                    f"{torch.__version__}")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (4, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted, report = unit_scale_with_report(
            model, (ids,), {"labels": ids, "use_cache": False}
        )
    assert len(report.residuals) == 4 and not report.untraceable

    class WithLoss(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
            return self.inner(input_ids, labels=labels, use_cache=False).loss

    assert fraction_unit(record_scales(WithLoss(converted), ids, ids)) >= 0.9
    assert fraction_unit(record_scales(WithLoss(model), ids, ids)) < 0.5


# ---------------------------------------------------------------- options and warnings


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 1)
        self.out = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.fc(x))
        return self.out(self.conv(hidden.unsqueeze(-1)).squeeze(-1))


def test_unconvertible_ops_are_named_in_a_warning() -> None:
    x = torch.randn(4, 8)
    with pytest.warns(UnitScaleWarning) as caught:
        converted = unit_scale(Odd(), (x,))
    message = str(caught[0].message)
    assert "tanh" in message and "conv (Conv1d)" in message
    assert isinstance(converted.graph_module.get_submodule("inner.conv"), nn.Conv1d)
    assert converted(x).shape == (4, 8)


def test_skip_and_replacements() -> None:
    x = torch.randn(4, 8)

    def unit_tanh(x: Tensor) -> Tensor:
        return torch.tanh(x) * 1.5

    _, report = unit_scale_with_report(
        Odd(), (x,), skip=["out", nn.Conv1d], function_replacements={torch.tanh: unit_tanh}
    )
    assert not report.unconverted
    converted = unit_scale(
        Odd(), (x,), skip=["out"], replacements={nn.Conv1d: lambda m: nn.Identity()},
        function_replacements={torch.tanh: torch.sigmoid},
    )
    inner = converted.graph_module
    assert type(inner.get_submodule("inner.out")) is nn.Linear
    assert type(inner.get_submodule("inner.fc")) is uu.Linear
    assert isinstance(inner.get_submodule("inner.conv"), nn.Identity)
    assert "sigmoid" in inner.code


def test_without_example_inputs_untraceable_parents_fall_back_to_children() -> None:
    model = plain_gpt()
    with pytest.warns(UnitScaleWarning, match="not traced"):
        converted = unit_scale(model)
    ids, labels = tokens()
    assert isinstance(converted.layers[0].attn.qkv, uu.Linear)
    assert torch.isfinite(converted(ids, labels))


# ---------------------------------------------------------------- training


def markov_tokens(steps: int, batch: int, seed: int = 0) -> List[Tensor]:
    """Token streams from a sparse random Markov chain: learnable, so the loss can fall."""
    generator = torch.Generator().manual_seed(seed)
    vocab = TINY.vocab_size
    successors = torch.randint(0, vocab, (vocab, 3), generator=generator)
    streams = []
    for _ in range(steps):
        current = torch.randint(0, vocab, (batch,), generator=generator)
        sequence = [current]
        for _ in range(TINY.seq_len):
            pick = torch.randint(0, 3, (batch,), generator=generator)
            current = successors[current, pick]
            sequence.append(current)
        streams.append(torch.stack(sequence, dim=1))
    return streams


def train(model: nn.Module, streams: List[Tensor]) -> List[float]:
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for stream in streams:
        loss = model(stream[:, :-1], stream[:, 1:])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def test_converted_gpt_trains_in_fp32_and_fp8_static() -> None:
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.transforms import simulate_fp8

    streams = markov_tokens(50, 8)
    example = (streams[0][:, :-1], streams[0][:, 1:])
    fp32 = unit_scale(plain_gpt(), example)
    fp8 = simulate_fp8(unit_scale(plain_gpt(), example), FP8Config(scaling="static"))
    assert any(type(m).__name__ == "FP8UnitScaledLinear" for m in fp8.modules())
    fp32_losses = train(fp32, streams)
    fp8_losses = train(fp8, streams)
    final_fp32 = sum(fp32_losses[-5:]) / 5
    final_fp8 = sum(fp8_losses[-5:]) / 5
    assert final_fp32 < 0.8 * fp32_losses[0]
    assert abs(final_fp8 - final_fp32) <= 0.05 * final_fp32


class TanhBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(torch.tanh(x))


def test_ops_right_after_a_residual_fork_are_still_checked():
    """The fork is a node the rewrite inserts; what reads it must still be converted or
    reported (here tanh, which has no unit-scaled form)."""
    x = torch.randn(8, 16)
    _, report = unit_scale_with_report(TanhBranch(), (x,))
    assert len(report.residuals) == 1
    assert [u for u in report.unconverted if "tanh" in u], report.unconverted


# ---------------------------------------------------------------- value-projection biases


class BiasedSelfAttention(nn.Module):
    """Separate q, k, v projections with biases around the fused attention (as in BERT)."""

    attention = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, width: int = 32, heads: int = 2, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        out = self.attention(split(self.query(x)), split(self.key(x)), split(self.value(x)),
                             is_causal=self.causal)
        return out.transpose(1, 2).reshape(batch, length, width)


def _value_bias_gradient(converted: nn.Module, x: Tensor, grad: Tensor) -> Tensor:
    converted.zero_grad(set_to_none=True)
    converted(x).backward(grad)
    return converted.value.bias.grad.clone()


@pytest.mark.parametrize("causal", [False, True])
def test_value_bias_gradient_is_divided_by_the_attention_row_scale(causal):
    """Rows of the attention matrix sum to 1, so attention(q, k, v + 1 b^T) = attention(q, k, v)
    + 1 b^T and the value bias's gradient is sum_i r_i g_i, r_i the row scale of query i. The
    rule divides it by the rows' root-mean-square r. Checked in float64 against that identity,
    written out: with the rule, without it (the rule off), and in the traced form."""
    from ipu_unit_scaling.ops.activation_ops import expected_softmax_square_sum
    from ipu_unit_scaling.ops.trace_switch import ipu_tracing

    batch, length, width, heads = 3, 16, 32, 2
    torch.manual_seed(0)
    converted = unit_scale(BiasedSelfAttention(width, heads, causal)).double()
    value = converted.value
    assert value.attention_projection == uu.AttentionProjection("value", 0.0, causal, 1.0)
    assert converted.query.attention_projection == uu.AttentionProjection("query", 0.0, causal)
    assert converted.key.attention_projection == uu.AttentionProjection("key", 0.0, causal)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, length, width, generator=gen, dtype=torch.float64)
    grad = torch.randn(batch, length, width, generator=gen, dtype=torch.float64)

    # The identity: each query row's gradient times its row scale, summed over the rows the
    # linear's own bias scale counts (batch * length).
    visible = torch.arange(1, length + 1, dtype=torch.float64) if causal else \
        torch.full((length,), float(length), dtype=torch.float64)
    row_scale = expected_softmax_square_sum(visible) ** -0.5  # (length,)
    per_head = grad.view(batch, length, heads, -1)
    through_rows = (per_head * row_scale[None, :, None, None]).sum(dim=(0, 1)).flatten()
    unscaled = through_rows * (batch * length) ** -0.5
    rms_row_scale = row_scale.pow(2).mean().sqrt()

    with_rule = _value_bias_gradient(converted, x, grad)
    torch.testing.assert_close(with_rule, unscaled / rms_row_scale)
    if not causal:  # one row scale: the rule gives exactly the gradient of a bias after attention
        after_attention = per_head.sum(dim=(0, 1)).flatten() * (batch * length) ** -0.5
        torch.testing.assert_close(with_rule, after_attention)
    with ipu_tracing():
        torch.testing.assert_close(_value_bias_gradient(converted, x, grad), with_rule)
    value.attention_projection = None
    torch.testing.assert_close(_value_bias_gradient(converted, x, grad), unscaled)


def test_value_bias_rule_leaves_the_rest_of_the_gradients_alone():
    """The rule is a cut edge: only the value bias's own gradient changes."""
    torch.manual_seed(0)
    converted = unit_scale(BiasedSelfAttention())
    x = torch.randn(4, 16, 32, requires_grad=True)
    grads = []
    for rule in (converted.value.attention_projection, None):
        converted.value.attention_projection = rule
        converted.zero_grad(set_to_none=True)
        x.grad = None
        out = converted(x)
        out.backward(torch.ones_like(out))
        grads.append({"x": x.grad.clone(), **{n: p.grad.clone()
                                              for n, p in converted.named_parameters()}})
    with_rule, without = grads
    for name in with_rule:
        if name.endswith("value.bias"):
            assert not torch.allclose(with_rule[name], without[name])
        else:
            torch.testing.assert_close(with_rule[name], without[name], rtol=0, atol=0)


def test_value_bias_rule_needs_a_value_only_linear():
    """A linear whose output also goes elsewhere (here: fused into q, k and v by slicing) is
    not marked: its bias gradient is not the values' alone."""

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x: Tensor) -> Tensor:
            qkv = self.qkv(x).view(4, 16, 3, 2, 16).transpose(1, 3)  # (4, 2, 3, 16, 16)
            return F.scaled_dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])

    converted = unit_scale(Fused())
    assert converted.qkv.attention_projection is None


@pytest.mark.parametrize("host_library", [True, False], ids=["values path", "codes path"])
def test_value_bias_rule_survives_simulate_fp8(host_library, monkeypatch):
    """The FP8 linear of a marked value projection scales its bias gradient by the same rule,
    on the CPU's values path and on the codes path: the bias gradient is a sum of the
    unquantised output gradient, so it equals the FP32 model's."""
    import copy

    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.fp8 import linear as fp8_linear_module
    from ipu_unit_scaling.transforms import simulate_fp8

    if not host_library:  # the codes path: what runs off the CPU fast path
        monkeypatch.setattr(fp8_linear_module, "values_path_applies", lambda *args: False)
    torch.manual_seed(0)
    converted = unit_scale(BiasedSelfAttention())
    fp8 = simulate_fp8(copy.deepcopy(converted), FP8Config(scaling="static"))
    assert type(fp8.value).__name__ == "FP8UnitScaledLinear"
    assert fp8.value.attention_projection == converted.value.attention_projection
    x, grad = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    expected = _value_bias_gradient(converted, x, grad)
    torch.testing.assert_close(_value_bias_gradient(fp8, x, grad), expected)
    converted.value.attention_projection = None
    assert not torch.allclose(_value_bias_gradient(converted, x, grad), expected)


# ---------------------------------------------------------------- query and key projections


@pytest.mark.parametrize("logit_std", [0.5, 1.0, 2.0])
def test_softmax_moments_by_quadrature_match_monte_carlo(logit_std):
    """E[sum p**2], E[sum p**3] and E[(sum p**2)**2] for the softmax of m independent normal
    logits, from the quadrature, against sampling in float64 (an independent estimate), and
    exactly 1 for one key."""
    from ipu_unit_scaling.ops.softmax_moments import softmax_moments

    moments = softmax_moments(200, logit_std)
    for values in moments:
        assert values[0] == pytest.approx(1.0, abs=1e-9)
    gen = torch.Generator().manual_seed(0)
    # The wider the logits, the heavier the tails of p**3 and p**4: more samples.
    samples = 2**21 if logit_std <= 1 else 2**23
    for keys in (2, 3, 8, 32, 200):
        p = torch.softmax(logit_std * torch.randn(samples // keys, keys, generator=gen,
                                                  dtype=torch.float64), dim=-1)
        square_sum = p.pow(2).sum(-1)
        sampled = (square_sum.mean(), p.pow(3).sum(-1).mean(), square_sum.pow(2).mean())
        for computed, estimate in zip(moments, sampled):
            assert computed[keys - 1] == pytest.approx(estimate.item(), rel=0.03), keys


@pytest.mark.parametrize("keys,causal,logit_std", [(2, False, 1.0), (8, False, 1.0),
                                                   (32, False, 1.0), (8, False, 2.0),
                                                   (16, True, 1.0)])
def test_query_key_grad_scale_is_the_inverse_gradient_std_of_unit_attention(keys, causal,
                                                                           logit_std):
    """The rule's derivation, checked on autograd: the query and key gradients of
    `U.scaled_dot_product_attention` with independent unit q, k, v and output gradient (float64,
    about 2**17 elements each) have std 1 / `attention_query_key_grad_scale`, within sampling
    error and the 1/head_dim terms the rule leaves out."""
    gen = torch.Generator().manual_seed(0)
    head_dim = 64
    shape = (2**17 // (keys * head_dim), 1, keys, head_dim)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    scale = logit_std / head_dim**0.5
    out = U.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    out.backward(torch.randn(out.shape, generator=gen, dtype=torch.float64))
    expected = 1 / U.attention_query_key_grad_scale(keys, causal, logit_std)
    assert q.grad.std().item() == pytest.approx(expected, rel=0.05)
    assert k.grad.std().item() == pytest.approx(expected, rel=0.05)
    # Far from 1 for few keys: the rule is doing something there.
    if keys <= 8 and logit_std == 1.0:
        assert expected < 0.8


def test_query_key_grad_scale_edge_cases():
    assert U.attention_query_key_grad_scale(1) == 1.0  # one key: the gradient is exactly 0
    assert U.attention_query_key_grad_scale(1, is_causal=True) == 1.0
    assert U.attention_query_key_grad_scale(4, logit_std=0.0) == 1.0
    # Many keys: attention's Jacobian loses nothing to the centring.
    assert U.attention_query_key_grad_scale(4096) == pytest.approx(1.0, abs=0.005)
    # Causal rows see 1..n keys: the first rows' gradients are smaller, so the scale is larger.
    assert U.attention_query_key_grad_scale(16, True) > U.attention_query_key_grad_scale(16)
    with pytest.raises(ValueError, match="role"):
        uu.AttentionProjection("output")


def _projection_gradients(model: nn.Module, x: Tensor, grad: Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    model(x).backward(grad)
    return {"x": x.grad, **{n: p.grad.clone() for n, p in model.named_parameters()}}


class UnitProjectionAttention(BiasedSelfAttention):
    """Self-attention with unit-scaled projections that each keep unit outputs (constraint
    None), marked as `unit_scale` marks them: the rule's own setting."""

    attention = staticmethod(uu.unit_attention)  # torch's logit scale 1/sqrt(head_dim)

    def __init__(self, width: int, heads: int, causal: bool) -> None:
        super().__init__(width, heads, causal)
        self.query, self.key, self.value = (
            uu.Linear(width, width, constraint=None,
                      attention_projection=uu.AttentionProjection(role, is_causal=causal))
            for role in ("query", "key", "value"))


@pytest.mark.parametrize("causal", [False, True])
def test_query_key_rule_makes_weight_gradients_unit_and_is_a_cut_edge(causal):
    """With independent unit inputs and output gradient, the query and key projections' weight
    gradients are unit with the rule and short of it without (8 keys: about 0.76 without).
    Only those two projections' own gradients change, by exactly the rule's factor."""
    torch.manual_seed(0)
    model = UnitProjectionAttention(width=64, heads=4, causal=causal)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, 64, generator=gen)
    grad = torch.randn(512, 8, 64, generator=gen)
    with_rule = _projection_gradients(model, x, grad)
    for name in ("query", "key"):
        getattr(model, name).attention_projection = None
    without = _projection_gradients(model, x, grad)
    factor = U.attention_query_key_grad_scale(8, causal)
    assert factor > 1.25
    for name in with_rule:
        if name.startswith(("query.", "key.")):
            torch.testing.assert_close(with_rule[name], without[name] * factor)
        else:
            torch.testing.assert_close(with_rule[name], without[name], rtol=0, atol=0)
    for name in ("query.weight", "key.weight"):
        assert with_rule[name].std().item() == pytest.approx(1.0, abs=0.08), name
        assert without[name].std().item() < 0.85, name


def test_query_key_rule_in_the_traced_form_and_through_simulate_fp8():
    """The same gradients under `ipu_tracing()` (the PopTorch form), and the FP8 linear of a
    marked projection applies the same factor (its gradient with the rule off, times it)."""
    import copy

    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.ops.trace_switch import ipu_tracing
    from ipu_unit_scaling.transforms import simulate_fp8

    torch.manual_seed(0)
    converted = unit_scale(BiasedSelfAttention()).double()
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    grad = torch.randn(4, 16, 32, dtype=torch.float64)
    eager = _projection_gradients(converted, x, grad)
    with ipu_tracing():
        traced = _projection_gradients(converted, x, grad)
    for name in eager:
        torch.testing.assert_close(traced[name], eager[name])

    converted = converted.float()
    fp8 = simulate_fp8(copy.deepcopy(converted), FP8Config(scaling="static"))
    assert fp8.query.attention_projection == converted.query.attention_projection
    x, grad = x.float(), grad.float()
    with_rule = _projection_gradients(fp8, x, grad)["query.weight"]
    fp8.query.attention_projection = None
    without = _projection_gradients(fp8, x, grad)["query.weight"]
    factor = U.attention_query_key_grad_scale(16)
    torch.testing.assert_close(with_rule, without * factor, rtol=1e-5, atol=1e-6)


def test_query_rule_is_for_self_attention_only():
    """The rule reads the key count from its linear's input length, which is the query
    length for a query projection: right in self-attention only. In cross-attention (queries
    from x, keys and values from a memory of another length) the query projection is left
    unmarked; the key and value projections are marked."""

    class CrossAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = (nn.Linear(32, 32) for _ in range(3))

        def forward(self, x: Tensor, memory: Tensor) -> Tensor:
            def split(t: Tensor) -> Tensor:  # reading t's shape does not make t shared
                return t.view(t.shape[0], t.size(1), 2, 16).transpose(1, 2)

            return F.scaled_dot_product_attention(split(self.query(x)), split(self.key(memory)),
                                                  split(self.value(memory)))

    converted = unit_scale(CrossAttention())
    assert converted.query.attention_projection is None
    assert converted.key.attention_projection == uu.AttentionProjection("key")
    assert converted.value.attention_projection == uu.AttentionProjection("value")


class _ModuleGELU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(x)


class _FunctionGELU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x)


@pytest.mark.parametrize("model", [_ModuleGELU, _FunctionGELU])
def test_converted_gelu_has_a_unit_output_and_the_output_scale_in_both_passes(model) -> None:
    from ipu_unit_scaling.ops.activation_ops import gelu_scales

    output_scale, grad_scale = gelu_scales("none", None, 1.0)  # 1/std(gelu(z)), 1/rms(gelu'(z))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 20, generator=generator, requires_grad=True)
    converted = unit_scale(model(), (x.detach(),))
    kinds = {type(m) for m in converted.modules()}
    assert (uu.GELU in kinds) == (model is _ModuleGELU)
    y = converted(x)
    y.backward(torch.randn(y.shape, generator=generator))
    # 2**20 unit-normal samples: a std estimate is within about 0.002 of its value.
    assert abs(y.std().item() - 1.0) < 0.01
    # The gradient takes the output scale too, so its rms is output_scale / grad_scale (1.15),
    # not the gmean tie's 1.
    assert abs(x.grad.pow(2).mean().sqrt().item() - output_scale / grad_scale) < 0.01
