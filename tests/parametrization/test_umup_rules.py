"""u-μP's rules with a choice (parametrization.umup_rules), each against its formula.

The expected scales are written out here in float64 from the u-μP paper (arXiv 2407.17465,
hidden weights' ``1/sqrt(fan_in)``) and from the published ``unit-scaling`` 0.3.5 library's
documented rules (``functional.linear`` with ``constraint="to_output_scale"``;
``functional.scaled_dot_product_attention``'s log-interpolated output scale), not computed by
the package. The GELU's scales come from its moments under N(0, 1), integrated here on a
float64 grid (the package uses Gauss-Hermite quadrature), tied by the constraint as the
library's ``scale_elementwise`` ties them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from ipu_unit_scaling.models import umup_decoder
from ipu_unit_scaling.parametrization.umup import UmupHyperparameters
from ipu_unit_scaling.parametrization.umup_rules import (
    UmupRules,
    constant_attention_scale,
    constant_scale_attention,
)

pytestmark = pytest.mark.numerics

VOCAB, SEQ, WIDTH, HEADS = 65, 32, 64, 4


def gpt(rules: Optional[UmupRules] = None, **hp: float):
    torch.manual_seed(0)
    return umup_decoder(VOCAB, WIDTH, 2, HEADS, SEQ, hyperparameters=UmupHyperparameters(**hp),
                        rules=rules)


def hidden_linears(model):
    layer = model.layers[0]
    return {"qkv": layer.attn.qkv, "proj": layer.attn.proj, "up": layer.mlp.up,
            "down": layer.mlp.down}


def expected_linear_scales(constraint: str, fan_in: int, fan_out: int):
    """(forward, input-gradient) multipliers: the paper's hidden 1/sqrt(fan_in) forward with
    the library's to_output_scale backward, or unit scaling's geometric mean for both."""
    if constraint == "to_output_scale":
        return fan_in**-0.5, fan_in**-0.5
    return (fan_in * fan_out) ** -0.25, (fan_in * fan_out) ** -0.25


# ------------------------------------------------------------------------------ hidden linears


@pytest.mark.parametrize("constraint", ["to_output_scale", "gmean", None])
def test_hidden_linears_scale_both_passes_as_the_rule_says(constraint):
    rules = None if constraint is None else UmupRules(hidden_constraint=constraint)
    constraint = constraint or "gmean"  # the measured default
    batch = 6
    for name, linear in hidden_linears(gpt(rules)).items():
        linear = linear.double()
        fan_out, fan_in = linear.weight.shape
        forward, backward = expected_linear_scales(constraint, fan_in, fan_out)
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(batch, fan_in, dtype=torch.float64, generator=generator,
                        requires_grad=True)
        grad = torch.randn(batch, fan_out, dtype=torch.float64, generator=generator)
        linear.weight.grad = None
        out = linear(x)
        out.backward(grad)
        weight = linear.weight.detach()
        torch.testing.assert_close(out.detach(), (x.detach() @ weight.T) * forward,
                                   rtol=1e-12, atol=1e-13, msg=name)
        torch.testing.assert_close(x.grad, (grad @ weight) * backward, rtol=1e-12, atol=1e-13,
                                   msg=name)
        torch.testing.assert_close(linear.weight.grad, (grad.T @ x.detach()) * batch**-0.5,
                                   rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize("constraint, power", [("to_output_scale", 0.0), ("gmean", 0.25)])
def test_hidden_forward_is_the_papers_times_fan_ratio_power(constraint, power):
    # The paper's hidden multiplier 1/sqrt(fan_in), times (fan_in/fan_out)**1/4 under gmean:
    # 0.71 for the MLP's up-projection, 1.41 for its down-projection.
    linears = hidden_linears(gpt(UmupRules(hidden_constraint=constraint)))
    for name, ratio in (("up", 1 / 4), ("down", 4.0)):
        linear = linears[name].double()
        x = torch.randn(4, linear.in_features, dtype=torch.float64)
        gain = (linear(x) / (x @ linear.weight.detach().T)).mean().item()
        assert gain == pytest.approx(linear.in_features**-0.5 * ratio**power, rel=1e-9), name


# ------------------------------------------------------------------------------ attention


def library_attention_scale(seq_len: int, head_dim: int, mult: float, is_causal: bool,
                            dropout_p: float = 0.0) -> float:
    """unit-scaling 0.3.5's rule, as its documentation states it: logits mult * q.k / head_dim,
    output times sqrt(1 - p) / log_interpolate(alpha, lower, upper=1) with
    alpha = 1 / (1 + 4 head_dim / mult**2), lower = sqrt(log(seq_len) / seq_len) if causal,
    else sqrt(1 / seq_len)."""
    alpha = 1.0 / (1.0 + 4.0 * head_dim / mult**2)
    lower = ((math.log(seq_len) if is_causal else 1.0) / seq_len) ** 0.5
    interpolated = math.exp(alpha * math.log(1.0) + (1.0 - alpha) * math.log(lower))
    return (1.0 - dropout_p) ** 0.5 / interpolated


@pytest.mark.parametrize("seq_len, head_dim, mult, is_causal, dropout_p", [
    (128, 32, 1.0, True, 0.0), (128, 32, 1.0, False, 0.0), (64, 16, 4.0, True, 0.1),
    (2, 8, 0.5, True, 0.0), (1000, 64, 2.0, False, 0.0),
])
def test_constant_attention_scale_is_the_librarys_formula(seq_len, head_dim, mult, is_causal,
                                                          dropout_p):
    logit_std = mult / math.sqrt(head_dim)  # of mult * q.k / head_dim for unit q, k
    assert constant_attention_scale(seq_len, logit_std, is_causal, dropout_p) == pytest.approx(
        library_attention_scale(seq_len, head_dim, mult, is_causal, dropout_p), rel=1e-12)


def test_one_key_keeps_the_value():
    assert constant_attention_scale(1, 0.2, True) == 1.0
    assert constant_attention_scale(1, 0.2, False) == 1.0


def explicit_attention(query, key, value, logit_scale: float, is_causal: bool):
    logits = query @ key.transpose(-2, -1) * logit_scale
    if is_causal:
        length = query.shape[-2]
        hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
        logits = logits.masked_fill(hidden, -math.inf)
    return torch.softmax(logits, dim=-1) @ value


@pytest.mark.parametrize("is_causal", [True, False])
def test_constant_scale_attention_is_softmax_attention_times_the_constant(is_causal):
    seq_len, head_dim, mult = 128, 32, 1.0
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, seq_len, head_dim, dtype=torch.float64, generator=generator,
                           requires_grad=True) for _ in range(3))
    out = constant_scale_attention(q, k, v, is_causal=is_causal, scale=mult / head_dim)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    out.backward(grad)
    factor = library_attention_scale(seq_len, head_dim, mult, is_causal)
    reference_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference = explicit_attention(*reference_inputs, mult / head_dim, is_causal) * factor
    reference.backward(grad)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-12)
    for got, want in zip((q, k, v), reference_inputs):  # the factor in the backward pass too
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
    # The first causal row sees only its own value: the constant shows there, undivided.
    if is_causal:
        torch.testing.assert_close(out[..., 0, :], v[..., 0, :].detach() * factor)


@pytest.mark.parametrize("is_causal, low, high", [(True, 0.9, 1.15), (False, 0.9, 1.1)])
def test_constant_scale_attention_output_is_near_unit_on_average(is_causal, low, high):
    # The library's model is of the output's std over all rows (uniform attention at small
    # logits: causal rows' variances average to (ln L + 0.58) / L, modelled as ln L / L).
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(8, 4, 128, 32, generator=generator) for _ in range(3))
    out = constant_scale_attention(q, k, v, is_causal=is_causal)  # u-μP's 1/head_dim logits
    assert low <= out.double().std().item() <= high


def test_the_gpt_uses_the_chosen_attention_rule():
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(2, SEQ, WIDTH, generator=generator)
    head_dim = WIDTH // HEADS
    for scaling in ("constant", "per-row"):
        attn = gpt(UmupRules(attention_scaling=scaling)).layers[0].attn
        qkv = attn.qkv(x).view(2, SEQ, 3, HEADS, head_dim).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)
        before = explicit_attention(query, key, value, 1 / head_dim, is_causal=True)
        out = attn(x)
        # proj is linear and bias-free: out = proj(before * row factors); recover the factors.
        unscaled = attn.proj(before.transpose(1, 2).reshape(2, SEQ, WIDTH))
        factors = (out * unscaled).sum(-1) / unscaled.pow(2).sum(-1)
        torch.testing.assert_close(out, unscaled * factors[..., None], rtol=1e-4, atol=1e-5)
        if scaling == "constant":
            expected = library_attention_scale(SEQ, head_dim, 1.0, True)
            torch.testing.assert_close(factors, torch.full_like(factors, expected), rtol=1e-4,
                                       atol=0)
        else:  # unit rows: the first row (one key) keeps 1, later rows get more
            assert factors[:, 0].sub(1).abs().max().item() < 1e-4
            assert bool((factors[:, -1] > 2).all())


# ------------------------------------------------------------------------------ GELU


def gelu_moments(mult: float):
    """(std of gelu(mult z), rms of d/dz gelu(mult z)) for z ~ N(0, 1), by the trapezoidal rule
    on a float64 grid; gelu(x) = x Phi(x), gelu'(x) = Phi(x) + x phi(x)."""
    z = torch.linspace(-14.0, 14.0, 400_001, dtype=torch.float64)
    density = torch.exp(-z**2 / 2) / math.sqrt(2 * math.pi)
    x = mult * z
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    value = x * cdf
    slope = mult * (cdf + x * torch.exp(-x**2 / 2) / math.sqrt(2 * math.pi))

    def mean(f):
        return torch.trapezoid(f * density, z).item()

    return math.sqrt(mean(value**2) - mean(value) ** 2), math.sqrt(mean(slope**2))


def expected_gelu_scales(constraint: str, mult: float):
    """(forward, input-gradient) multipliers: 1/std and 1/rms, both the forward's under
    to_output_scale, both their geometric mean under gmean."""
    output_std, grad_rms = gelu_moments(mult)
    if constraint == "to_output_scale":
        return 1 / output_std, 1 / output_std
    return (output_std * grad_rms) ** -0.5, (output_std * grad_rms) ** -0.5


@pytest.mark.parametrize("mult", [1.0, 2.0])
@pytest.mark.parametrize("constraint", ["to_output_scale", "gmean", None])
def test_gelu_scales_both_passes_as_the_rule_says(constraint, mult):
    rules = None if constraint is None else UmupRules(gelu_constraint=constraint)
    constraint = constraint or "to_output_scale"  # the library's, kept by the measurement
    forward, backward = expected_gelu_scales(constraint, mult)
    gelu = gpt(rules, ffn_act_mult=mult).layers[0].mlp.gelu
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, dtype=torch.float64, generator=generator, requires_grad=True)
    grad = torch.randn(4, 256, dtype=torch.float64, generator=generator)
    out = gelu(x)
    out.backward(grad)
    plain = x.detach().requires_grad_()
    reference = torch.nn.functional.gelu(mult * plain)
    reference.backward(grad)
    torch.testing.assert_close(out.detach(), reference.detach() * forward, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(x.grad, plain.grad * backward, rtol=1e-7, atol=1e-9)


def test_the_gelu_rules_differ_by_what_the_tie_moves():
    # At mult 1 the two rules' backward scales are 1/std and 1/sqrt(std * rms): the test above
    # separates them only if these differ by far more than its tolerance.
    to_output, _ = expected_gelu_scales("to_output_scale", 1.0)
    gmean, _ = expected_gelu_scales("gmean", 1.0)
    assert abs(to_output / gmean - 1) > 0.05


# ------------------------------------------------------------------------------ config


def test_rules_are_model_keys_only_u_mup_takes():
    from ipu_unit_scaling.training.config_files import ConfigError
    from ipu_unit_scaling.training.precision import build_model, with_model_kind
    from ipu_unit_scaling.training.run_config import load_config

    config = load_config("umup", ["precision.dtype=fp32",
                                  "model.umup_hidden_constraint=to_output_scale",
                                  "model.umup_attention_scaling=per-row",
                                  "model.umup_gelu_constraint=gmean"])
    model = build_model(config)
    assert model.layers[0].mlp.up.constraint == "to_output_scale"
    assert model.layers[0].mlp.gelu.constraint == "gmean"
    assert model.layers[0].attn.attention is not constant_scale_attention
    default = build_model(load_config("umup", ["precision.dtype=fp32"])).layers[0]
    assert default.attn.attention is constant_scale_attention
    assert default.mlp.up.constraint == "gmean"
    assert default.mlp.gelu.constraint == "to_output_scale"
    # the u-μP keys go back to their defaults
    config = dataclasses.replace(config, model=with_model_kind(config.model, "unit"))
    assert (config.model.umup_hidden_constraint, config.model.umup_attention_scaling,
            config.model.umup_gelu_constraint) == ("gmean", "constant", "to_output_scale")
    cases = {
        "model.umup_hidden_constraint": ["model.umup_hidden_constraint=to_output_scale"],
        "model.umup_attention_scaling": ["model.parametrization=u-mup",
                                         "model.umup_attention_scaling=per_row"],
        "model.umup_gelu_constraint": ["model.umup_gelu_constraint=gmean"],
    }
    for key, overrides in cases.items():
        with pytest.raises(ConfigError) as error:
            load_config(None, overrides)
        assert [path for path, _ in error.value.errors] == [key], overrides
    with pytest.raises(ValueError, match="hidden_constraint 'hmean'"):
        UmupRules(hidden_constraint="hmean")
    with pytest.raises(ValueError, match="gelu_constraint 'none'"):
        UmupRules(gelu_constraint="none")


@pytest.mark.parametrize("parametrization, attention, gelu", [
    ("u-mup", "per-row", "gmean"), ("unit", "constant", "to_output_scale")])
def test_a_run_saved_before_the_rule_keys_loads_with_the_rules_it_trained_with(
        tmp_path, parametrization, attention, gelu):
    """A u-μP run saved before these keys scaled attention per row and tied its GELU's scales
    by gmean: resuming or evaluating it must not switch it to today's defaults. A unit-scaled
    run (which has no u-μP GELU) gets the defaults, which are all it may hold."""
    import yaml

    from ipu_unit_scaling.loop.run_opening import load_run_config
    from ipu_unit_scaling.models import GPTConfig
    from ipu_unit_scaling.training.run_config import Config

    config = Config(model=GPTConfig(parametrization=parametrization))
    raw = config.to_dict()
    for key in ("umup_hidden_constraint", "umup_attention_scaling", "umup_gelu_constraint",
                "factory"):
        del raw["model"][key]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    loaded = load_run_config(tmp_path, action="resume")
    assert loaded.model.umup_attention_scaling == attention
    assert loaded.model.umup_hidden_constraint == "gmean" and loaded.model.factory is None
    assert loaded.model.umup_gelu_constraint == gelu
