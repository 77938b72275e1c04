"""u-μP: each rule against its formula, and unit scale at initialisation.

Sources of the formulas: Blake et al. 2024, "u-μP: The Unit-Scaled Maximal Update
Parametrization" (arXiv 2407.17465), sections 3-4 and appendix G; the published library
``unit-scaling`` 0.3.5 (``unit_scaling/optim.py`` for the learning rates,
``unit_scaling/core/functional.py: transformer_residual_scaling_rule`` for the residual taus,
``unit_scaling/functional.py: linear_readout`` and ``scaled_dot_product_attention`` for the
readout and attention multipliers). The expected values below are written out from those
formulas, not computed by the package.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipu_unit_scaling as uu
import ipu_unit_scaling.functional as U
from ipu_unit_scaling.models import umup_decoder
from ipu_unit_scaling.parametrization.umup import (
    ScaledGELU,
    UmupHyperparameters,
    WeightRule,
    lr_scale,
    residual_taus,
    residual_weights,
    weight_rules,
)
from ipu_unit_scaling.scale import scale_fwd

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

VOCAB, SEQ = 65, 32


def gpt(width: int = 64, depth: int = 3, heads: int = 4, seed: int = 0, **hp: float):
    torch.manual_seed(seed)
    return umup_decoder(VOCAB, width, depth, heads, SEQ, hyperparameters=UmupHyperparameters(**hp))


def batch(size: int = 8, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (size, SEQ), generator=generator),
            torch.randint(0, VOCAB, (size, SEQ), generator=generator))


# ------------------------------------------------------------------------------ residuals


@pytest.mark.parametrize("depth", [1, 2, 5])
@pytest.mark.parametrize("mult, ratio", [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)])
def test_residual_taus_follow_the_published_rule(depth, mult, ratio):
    # transformer_residual_scaling_rule (appendix G): branch i of 2L, with n_attn attention and
    # n_mlp MLP branches before it, has tau = a_i / sqrt(L + n_attn a_attn^2 + n_mlp a_mlp^2),
    # a_mlp = mult sqrt(2 / (1 + ratio^2)), a_attn = ratio a_mlp.
    a_mlp = mult * math.sqrt(2 / (1 + ratio**2))
    a_attn = ratio * a_mlp
    expected = []
    for i in range(2 * depth):
        n_attn, n_mlp = (i + 1) // 2, i // 2
        a = a_attn if i % 2 == 0 else a_mlp
        expected.append(a / math.sqrt(depth + n_attn * a_attn**2 + n_mlp * a_mlp**2))
    taus = [tau for pair in residual_taus(depth, mult, ratio) for tau in pair]
    assert taus == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("depth", [1, 4, 16])
def test_residual_shares_do_not_depend_on_depth(depth):
    # Play residual_add's arithmetic (branch weight a, skip weight b, a/b = tau, a^2 + b^2 = 1)
    # on variance shares: the final stream holds the embedding, every attention branch and every
    # MLP branch in the proportions 1 : a_attn^2/L : a_mlp^2/L, whatever the depth.
    mult, ratio = 1.5, 0.5
    shares = {"embedding": 1.0}
    for layer, (attn_tau, mlp_tau) in enumerate(residual_taus(depth, mult, ratio)):
        for name, tau in ((f"attn{layer}", attn_tau), (f"mlp{layer}", mlp_tau)):
            skip = 1 / (1 + tau**2)
            shares = {k: v * skip for k, v in shares.items()}
            shares[name] = tau**2 / (1 + tau**2)
    assert sum(shares.values()) == pytest.approx(1.0)
    embedding = shares["embedding"]
    attention = sum(v for k, v in shares.items() if k.startswith("attn")) / embedding
    mlp = sum(v for k, v in shares.items() if k.startswith("mlp")) / embedding
    assert (attention + mlp) / 2 == pytest.approx(mult**2)  # alpha_res: average against emb
    assert attention / mlp == pytest.approx(ratio**2)  # alpha_res-attn-ratio
    per_branch = [v for k, v in shares.items() if k.startswith("attn")]
    assert max(per_branch) == pytest.approx(min(per_branch))  # every layer the same share
    assert residual_weights(depth, mult, ratio)[0] == pytest.approx(attention / depth)


def test_the_gpt_uses_the_taus_and_its_residual_stream_stays_unit():
    model = gpt(width=128, depth=4)
    for layer, (attn_tau, mlp_tau) in zip(model.layers, residual_taus(4)):
        assert (layer.attn_tau, layer.mlp_tau) == (attn_tau, mlp_tau)
    ids, _ = batch()
    hidden = model.embed(ids)
    stds = [hidden.std().item()]
    for layer in model.layers:
        hidden = layer(hidden)
        stds.append(hidden.std().item())
    assert all(0.7 <= s <= 1.4 for s in stds), stds


# ------------------------------------------------------------------------------ multipliers


@pytest.mark.parametrize("mult", [1.0, 4.0])
def test_attention_logits_are_scaled_by_mult_over_head_dim(mult):
    # u-μP's attention: softmax(alpha_attn q.k / d_head) (μP's 1/d), times an output factor
    # (one per row at most; tests/parametrization/test_umup_rules.py checks the factors).
    width, heads = 64, 4
    head_dim = width // heads
    model = gpt(width=width, heads=heads, attn_softmax_mult=mult)
    mhsa = model.layers[0].attn
    assert mhsa.attention_scale == mult / head_dim
    x = torch.randn(2, SEQ, width)
    seen = {}
    mhsa.register_forward_hook(lambda module, args, out: seen.update(out=out))
    qkv = mhsa.qkv(x).view(2, SEQ, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    query, key, value = qkv.unbind(0)
    attended = mhsa.attention(query, key, value, is_causal=True, scale=mult / head_dim)

    def per_row_mismatch(logit_scale: float) -> float:
        """How far the output is from softmax(scale q.k) v times one best factor per row."""
        logits = query @ key.transpose(-2, -1) * logit_scale
        logits = logits.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), -math.inf)
        explicit = torch.softmax(logits, dim=-1) @ value  # before the output factor
        factor = (attended * explicit).sum(-1, keepdim=True) / explicit.pow(2).sum(-1, True)
        assert bool((factor > 0).all())
        return ((attended - factor * explicit).norm() / attended.norm()).item()

    assert per_row_mismatch(mult / head_dim) < 1e-5
    assert per_row_mismatch(mult / math.sqrt(head_dim)) > 1e-2  # not the standard 1/sqrt(d)
    mhsa(x)
    expected = mhsa.proj(attended.transpose(1, 2).reshape(2, SEQ, width))
    torch.testing.assert_close(seen["out"], expected)


@pytest.mark.parametrize("loss_mult", [1.0, 0.25])
def test_readout_is_one_over_fan_in_forward_and_unit_backward(loss_mult):
    # linear_readout: forward 1/fan_in (times alpha_loss-softmax), input gradient 1/sqrt(fan_out).
    width = 64
    model = gpt(width=width, loss_softmax_mult=loss_mult)
    x = torch.randn(16, width, requires_grad=True)
    logits = scale_fwd(model.head(x), model.logit_scale)
    weight = model.head.weight
    torch.testing.assert_close(logits, loss_mult * x @ weight.t() / width)
    grad = torch.randn_like(logits)
    logits.backward(grad)
    torch.testing.assert_close(x.grad, grad @ weight / math.sqrt(VOCAB))
    assert weight.grad is not None and 0.5 < weight.grad.std().item() < 2  # unit: batch**-0.5


def test_logits_of_the_gpt_are_its_readout_times_the_loss_multiplier():
    model = gpt(width=64, loss_softmax_mult=2.0)
    ids, labels = batch(2)
    seen = {}
    model.final_norm.register_forward_hook(lambda m, args, out: seen.update(h=out))
    loss, logits = model(ids, labels, return_logits=True)
    torch.testing.assert_close(logits, 2.0 * seen["h"] @ model.head.weight.t() / 64)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
def test_scaled_gelu_is_unit_for_any_mult(mult):
    torch.manual_seed(0)
    x = torch.randn(2**18, requires_grad=True)
    gelu = ScaledGELU(mult, constraint=None)  # exact forward and backward scales
    out = gelu(x)
    out.backward(torch.randn_like(out))
    assert abs(out.std().item() - 1) < 0.02
    assert abs(x.grad.std().item() - 1) < 0.02
    # It is gelu(mult x), up to a constant: the multiplier changes the nonlinearity's shape.
    shape = F.gelu(mult * x.detach())
    torch.testing.assert_close(out.detach(), shape * (out.detach() / shape)[0], rtol=1e-4,
                               atol=1e-5)


def test_scaled_gelu_at_mult_one_is_the_unit_scaled_gelu():
    x = torch.randn(64, 32, requires_grad=True)
    for constraint in ("to_output_scale", "gmean"):
        torch.testing.assert_close(ScaledGELU(1.0, constraint=constraint)(x),
                                   U.gelu(x, constraint=constraint), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ScaledGELU(1.0)(x), U.gelu(x), rtol=1e-6, atol=1e-6)
    assert model_gelu(gpt(ffn_act_mult=3.0)).mult == 3.0


def model_gelu(model: nn.Module) -> ScaledGELU:
    gelu = model.layers[0].mlp.gelu
    assert isinstance(gelu, ScaledGELU)
    return gelu


def test_every_hyperparameter_changes_the_loss_at_init():
    ids, labels = batch(2)
    base = gpt()(ids, labels).item()
    for name in ("residual_mult", "residual_attn_ratio", "attn_softmax_mult", "ffn_act_mult",
                 "loss_softmax_mult"):
        changed = gpt(**{name: 2.0})(ids, labels).item()
        assert changed != base, name


# ------------------------------------------------------------------------------ weight types


def test_weight_types_of_the_gpt():
    model = gpt(width=64, depth=3)
    rules = weight_rules(model)
    assert set(rules) == {name for name, _ in model.named_parameters()}
    expected = {
        "embedding.weight": ("embedding", None),
        "position_embedding.weight": ("embedding", None),
        "layers.0.attn_norm.weight": ("norm", 3),
        "layers.2.attn.qkv.weight": ("hidden", 3),
        "layers.1.attn.proj.weight": ("hidden", 3),
        "layers.0.mlp.up.weight": ("hidden", 3),
        "layers.0.mlp.down.weight": ("hidden", 3),
        "layers.2.mlp_norm.weight": ("norm", 3),
        "final_norm.weight": ("norm", None),
        "head.weight": ("output", None),
    }
    for name, (weight_type, depth) in expected.items():
        assert (rules[name].weight_type, rules[name].residual_depth) == (weight_type, depth), name


def test_lr_scales_follow_the_table():
    # lr_scale_func_adam (and _sgd without a readout constraint): embedding 1/sqrt(fan_out),
    # hidden 1/sqrt(fan_in), output, norm and bias 1; times 1/sqrt(depth) inside residual blocks.
    assert lr_scale(WeightRule("embedding", (65, 256))) == 256**-0.5
    assert lr_scale(WeightRule("hidden", (1024, 256), 4)) == pytest.approx(256**-0.5 / 2)
    assert lr_scale(WeightRule("hidden", (256, 1024), 4)) == pytest.approx(1024**-0.5 / 2)
    assert lr_scale(WeightRule("output", (65, 256))) == 1.0
    assert lr_scale(WeightRule("norm", (256,), 9)) == pytest.approx(1 / 3)
    assert lr_scale(WeightRule("bias", (256,))) == 1.0
    with pytest.raises(ValueError, match="weight_type"):
        WeightRule("conv", (3, 3))


def test_weight_types_survive_fp8_and_fp16_conversion():
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.training.precision import simulate_fp16
    from ipu_unit_scaling.transforms import simulate_fp8

    reference = weight_rules(gpt())
    assert weight_rules(simulate_fp8(gpt(), FP8Config(scaling="static"))) == reference
    assert weight_rules(simulate_fp16(gpt())) == reference


def test_untypeable_parameters_and_missing_readouts_are_refused():
    class WithScalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(()))
            self.head = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="'gain'"):
        weight_rules(WithScalar(), residual_blocks=())
    with pytest.raises(ValueError, match="readout"):
        weight_rules(nn.Sequential(nn.Linear(4, 4)), residual_blocks=())


def test_unit_scale_converted_models_can_be_typed():
    from ipu_unit_scaling.transforms import unit_scale

    plain = nn.Sequential(nn.Embedding(10, 16), nn.LayerNorm(16), nn.Linear(16, 16),
                          nn.Linear(16, 10))
    model = unit_scale(plain, (torch.randint(0, 10, (2, 5)),))
    # The converted copy keeps the layers under the traced graph module, in their order.
    inner = "graph_module.inner"
    rules = weight_rules(model, readout=[f"{inner}.3"], residual_blocks=())
    assert [rules[f"{inner}.{name}"].weight_type for name in (
        "0.weight", "1.weight", "1.bias", "2.weight", "3.weight")] == [
        "embedding", "norm", "bias", "hidden", "output"]


# ------------------------------------------------------------------------------ at init


def test_umup_gpt_at_init_has_unit_gradients_like_uu():
    # As tests/modules/test_modules.py checks for the unit-scaled GPT: every parameter
    # gradient near unit.
    model = gpt(width=128, depth=4)
    ids, labels = batch()
    model(ids, labels).backward()
    stds = {name: p.grad.std().item() for name, p in model.named_parameters()}
    out_of_range = {k: v for k, v in stds.items() if not 0.25 <= v <= 4}
    assert not out_of_range, out_of_range


def test_umup_logits_start_small_and_grow_with_the_loss_multiplier():
    # μP's readout makes the initial logits O(1/sqrt(width)): the model starts near uniform.
    ids, _ = batch(2)
    narrow, wide = gpt(width=64)(ids).std().item(), gpt(width=256)(ids).std().item()
    assert narrow == pytest.approx(64**-0.5, rel=0.2)
    assert wide == pytest.approx(256**-0.5, rel=0.2)


def test_uu_gpt_is_unchanged_by_the_new_options():
    torch.manual_seed(0)
    default = uu.GPT(VOCAB, 32, 2, 2, SEQ)
    torch.manual_seed(0)
    explicit = uu.GPT(VOCAB, 32, 2, 2, SEQ, taus=[(0.2, 0.5)] * 2, attention_scale=None,
                      logit_scale=1.0)
    ids, labels = batch(2)
    assert default(ids, labels).item() == explicit(ids, labels).item()


# ------------------------------------------------------------------------------ cross-check


def test_matches_the_published_library_where_it_is_installed():
    library = pytest.importorskip("unit_scaling", reason="the published unit-scaling library")
    from unit_scaling.core.functional import transformer_residual_scaling_rule

    rule = transformer_residual_scaling_rule(1.5, 0.7)
    ours = [tau for pair in residual_taus(3, 1.5, 0.7) for tau in pair]
    assert ours == pytest.approx([rule(i, 6) for i in range(6)], rel=1e-12)
    layer = library.Linear(64, 256)
    layer.weight.mup_scaling_depth = 4
    assert lr_scale(WeightRule("hidden", (256, 64), 4)) == pytest.approx(
        library.optim.lr_scale_func_adam(layer.weight))
    embedding = library.Embedding(65, 64)
    assert lr_scale(WeightRule("embedding", (65, 64))) == pytest.approx(
        library.optim.lr_scale_func_adam(embedding.weight))


# ------------------------------------------------------------------------------ config


def test_config_refuses_keys_the_parametrization_would_ignore():
    from ipu_unit_scaling.training.config_files import ConfigError
    from ipu_unit_scaling.training.run_config import load_config

    load_config(None, ["model.parametrization=u-mup", "model.residual_mult=2"])  # fine
    cases = {
        "model.residual_mult": ["model.residual_mult=2"],  # only u-mup uses it
        "model.attn_tau": ["model.parametrization=u-mup", "model.attn_tau=0.3"],
        "model.parametrization": ["model.parametrization=u-mup", "model.unit_scaled=false"],
        "model.loss_softmax_mult": ["model.parametrization=u-mup", "model.loss_softmax_mult=0"],
        "model.residual_attn_ratio": ["model.parametrization=u-mup",
                                      "model.residual_attn_ratio=1e300"],
    }
    for key, overrides in cases.items():
        with pytest.raises(ConfigError) as error:
            load_config(None, overrides)
        assert [path for path, _ in error.value.errors] == [key], overrides
    with pytest.raises(ConfigError, match="did you mean 'u-mup'"):
        load_config(None, ["model.parametrization=u-mu"])


def test_the_umup_config_builds_the_umup_gpt():
    from ipu_unit_scaling.training.precision import build_model
    from ipu_unit_scaling.training.run_config import load_config

    config = load_config("umup", ["precision.dtype=fp32", "model.attn_softmax_mult=2"])
    assert config.training.learning_rate == 1.0
    model = build_model(config)
    width, heads = config.model.hidden_size, config.model.heads
    assert model.layers[0].attn.attention_scale == 2 / (width // heads)
    assert model.logit_scale == pytest.approx(width**-0.5) and model.head.constraint is None


# ------------------------------------------------------------------------------ FP8


def test_static_fp8_needs_no_scaling_in_umup_either():
    # Unit scale is what lets plain FP8 casts (scale 2^0) work; u-μP keeps it, so at init the
    # casts of the forward and backward pass flush and saturate almost nothing.
    from ipu_unit_scaling.fp8 import FP8Config, fp8_stats
    from ipu_unit_scaling.transforms import simulate_fp8

    ids, labels = batch()
    reference = gpt(width=128, depth=4)(ids, labels).item()
    model = simulate_fp8(gpt(width=128, depth=4), FP8Config(scaling="static"))
    with fp8_stats() as stats:
        loss = model(ids, labels)
        loss.backward()
    assert loss.item() == pytest.approx(reference, rel=0.01)
    assert len(stats.records) > 0
    flushed = sum(r.flushed for r in stats.records) / sum(r.nonzero for r in stats.records)
    assert flushed < 0.01
    assert sum(r.saturated for r in stats.records) == 0
