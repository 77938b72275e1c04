"""Every regime trains the model its name says, built through the command line's own path.

`compare` (GPT), `train` with a regime's settings (GPT) and `compare --model bert` (the
BERT-style encoder) each run one short training per regime while the builders are watched;
the models they built are then judged by what they do and hold, not by the settings that
asked for them:

- plain (`fp32`, `fp16`, `fp8-*`): torch's modules at torch's initialisation, plain ops, and
  linears that compute `x @ W.T` with no scale;
- unit-scaled (`unit-*`): unit-scaled embeddings, norms and ops, unit-variance weights, and
  linears whose output is scaled down from `x @ W.T`;
- u-μP (`umup-*`, GPT only; the encoder refuses them): the unit-scaled model plus u-μP's
  activation, attention and logit scales, its readout, and its per-type learning rates;
- precision: `fp16` regimes round every linear's output to float16, `fp8` regimes cast every
  linear to FP8 with the regime's scaling, `fp32` regimes do neither.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from helpers import ONE_IPU
from torch import nn

import ipu_unit_scaling as uu
from ipu_unit_scaling import functional as U
from ipu_unit_scaling.apps import mlm
from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.fp8 import FP8Linear, FP8UnitScaledLinear
from ipu_unit_scaling.loop import run_session
from ipu_unit_scaling.loop.tasks import CausalLM, MaskedLM
from ipu_unit_scaling.parametrization import umup as umup_rules
from ipu_unit_scaling.parametrization.umup_rules import constant_scale_attention
from ipu_unit_scaling.training.config_names import REGIMES
from ipu_unit_scaling.training.precision import REGIME_SETTINGS, FP16Linear

# The tiny config on one stage, one step, no evaluation between: the fastest run that builds
# its model as a real run does.
GPT_FAST = [*ONE_IPU,
            "training.steps=1", "training.eval_batches=1"]
BERT_FAST = ["mlm.hidden_size=32", "mlm.depth=1", "mlm.heads=2", "mlm.seq_len=24",
             "mlm.min_len=8", "mlm.batch_size=4", "mlm.steps=1", "mlm.warmup_steps=0",
             "mlm.eval_batches=1"]
BERT_REGIMES = [r for r in REGIMES if REGIME_SETTINGS[r][0] != "u-mup"]


def _kind(regime: str) -> str:
    return REGIME_SETTINGS[regime][0]


def _dtype(regime: str) -> str:
    return REGIME_SETTINGS[regime][1]


# ---------------------------------------------------------------- judging a built model


def _linear_gain(linear: nn.Linear) -> float:
    """How much `linear` scales `x @ W.T (+ b)`: 1 for a plain linear (up to its precision's
    rounding), its output scale (well below 1 here) for a unit-scaled one."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, linear.in_features, generator=generator)
    with torch.no_grad():
        reference = F.linear(x, linear.weight, linear.bias)
        return float(linear(x).norm() / reference.norm())


def _linears(model: nn.Module) -> List[Tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _ops_tables(model: nn.Module) -> List[uu.Ops]:
    return [m.ops for m in model.modules() if isinstance(getattr(m, "ops", None), uu.Ops)]


def assert_plain(model: nn.Module) -> None:
    unit_classes = (uu.Linear, uu.LayerNorm, uu.Embedding, FP8UnitScaledLinear)
    unit_parts = [name for name, m in model.named_modules() if isinstance(m, unit_classes)]
    assert not unit_parts, f"unit-scaled modules in a plain model: {unit_parts}"
    tables = _ops_tables(model)
    assert tables and all(table == uu.TORCH_OPS for table in tables)
    for name, linear in _linears(model):
        # torch's initialisation: uniform within 1/sqrt(fan_in), std 1/sqrt(3 fan_in).
        assert float(linear.weight.detach().std()) < 2 / math.sqrt(3 * linear.in_features), name
        # FP8 rounds each operand and the output by at most 2^-4 (E4M3) relative.
        assert _linear_gain(linear) == pytest.approx(1.0, abs=0.1), name


def assert_unit_scaled(model: nn.Module) -> None:
    plain_parts = [name for name, m in model.named_modules()
                   if type(m) in (nn.Linear, nn.LayerNorm, nn.Embedding)]
    assert not plain_parts, f"plain modules in a unit-scaled model: {plain_parts}"
    tables = _ops_tables(model)
    assert tables
    for table in tables:
        assert table.residual_add is U.residual_add
        # unit scaling's per-row attention, or u-μP's one constant (assert_umup tells which)
        assert table.scaled_dot_product_attention in (uu.unit_attention,
                                                      constant_scale_attention)
        assert table.cross_entropy is U.cross_entropy
        assert type(table.LayerNorm(8)) is uu.LayerNorm and table.Embedding is uu.Embedding
    for name, linear in _linears(model):
        assert 0.8 < float(linear.weight.detach().std()) < 1.25, name  # unit initialisation
        # Every linear here has fan_in >= 32: its output scale is at most 32**-0.25 < 0.5.
        assert _linear_gain(linear) < 0.5, name


def assert_umup(model: nn.Module, kind: str) -> None:
    """u-μP's activation, attention and logit scales and readout in a `u-mup` model; none of
    them in another."""
    umup = kind == "u-mup"
    gelus = [table.gelu for table in _ops_tables(model)]
    assert all(isinstance(g, umup_rules.ScaledGELU) == umup for g in gelus)
    if kind != "plain":
        attention = constant_scale_attention if umup else uu.unit_attention
        assert all(t.scaled_dot_product_attention is attention for t in _ops_tables(model))
    attention_scales = {m.attention_scale for m in model.modules()
                        if isinstance(m, uu.SelfAttention)}
    logit_scale = getattr(model, "logit_scale", 1.0)
    if not umup:
        assert attention_scales == {None} and logit_scale == 1.0
        return
    hidden = model.embedding.embedding_dim
    head_dim = hidden // model.layers[0].attn.heads
    assert attention_scales == {umup_rules.attention_logit_scale(head_dim)}
    assert logit_scale == umup_rules.logit_scale(hidden)
    # The readout has no constraint: its output scale is exactly 1/sqrt(fan_in).
    assert _linear_gain(model.head) == pytest.approx(hidden**-0.5, rel=0.1)


def assert_precision(model: nn.Module, regime: str) -> None:
    dtype, scaling = REGIME_SETTINGS[regime][1:]
    linears = _linears(model)
    assert linears
    for name, linear in linears:
        if dtype == "fp8":
            assert isinstance(linear, FP8Linear), name
            assert linear.config.scaling == scaling, name
        else:
            assert not isinstance(linear, FP8Linear), name
        assert isinstance(linear, FP16Linear) == (dtype == "fp16"), name
        if dtype == "fp16":
            output = linear(torch.randn(8, linear.in_features))
            assert torch.equal(output, output.half().float()), name


def assert_is_the_regime(model: nn.Module, regime: str) -> None:
    kind = _kind(regime)
    if kind == "plain":
        assert_plain(model)
    else:
        assert_unit_scaled(model)
    if hasattr(model, "logit_scale"):  # the GPT; the encoder has no u-μP form
        assert_umup(model, kind)
    assert_precision(model, regime)


# ---------------------------------------------------------------- watching the builders


@pytest.fixture
def gpt_builds(monkeypatch) -> List[Dict[str, Any]]:
    """The model and optimizer of every GPT run, in order."""
    built: List[Dict[str, Any]] = []

    def build_model(self, config):
        model = real_build_model(self, config)
        built.append({"model": model})
        return model

    def make_optimizer(model, config, *args, **kwargs):
        optimizer = real_make_optimizer(model, config, *args, **kwargs)
        # As built: the schedule changes the groups' rates as training goes.
        built[-1].update(rates=[group["lr"] for group in optimizer.param_groups],
                         learning_rate=config.training.learning_rate)
        return optimizer

    real_build_model, real_make_optimizer = CausalLM.build_model, run_session.make_optimizer
    monkeypatch.setattr(CausalLM, "build_model", build_model)
    monkeypatch.setattr(run_session, "make_optimizer", make_optimizer)
    return built


def _assert_learning_rates(build: Dict[str, Any], kind: str) -> None:
    rates = build["rates"]
    if kind == "u-mup":  # per weight type: embeddings, hidden weights and readout differ
        assert len(set(rates)) > 1, rates
    else:
        assert rates == [build["learning_rate"]]


def test_compare_builds_each_regime_as_named(gpt_builds, tmp_path, capsys):
    # Each kind's regimes get their own rate, so a rate shows which kind's setting was read.
    rates = {regime: 0.001 * (1 + index) for index, regime in enumerate(REGIMES)}
    status = main(["compare", "--config", "tiny", "--run-dir", str(tmp_path), "--quiet",
                   "--regimes", *REGIMES, "--set", *GPT_FAST,
                   *[f"compare.learning_rates.{r}={rate}" for r, rate in rates.items()]])
    out = capsys.readouterr().out
    assert status == 0
    assert len(gpt_builds) == len(REGIMES)
    for regime, build in zip(REGIMES, gpt_builds):
        assert_is_the_regime(build["model"], regime)
        assert build["learning_rate"] == rates[regime]
        _assert_learning_rates(build, _kind(regime))
    names = {"plain": "plain", "unit": "unit-scaled", "u-mup": "u-μP"}
    for regime in REGIMES:
        assert f"| {regime} | {names[_kind(regime)]} |" in out


def _train_settings(regime: str) -> List[str]:
    kind, dtype, scaling = REGIME_SETTINGS[regime]
    return [f"model.unit_scaled={str(kind != 'plain').lower()}",
            f"model.parametrization={'u-mup' if kind == 'u-mup' else 'unit'}",
            f"precision.dtype={dtype}", f"precision.fp8.scaling={scaling}"]


@pytest.mark.parametrize("regime", REGIMES)
def test_train_with_a_regime_settings_builds_that_regime(regime, gpt_builds, tmp_path, capsys):
    status = main(["train", "--config", "tiny", "--run-dir", str(tmp_path), "--quiet",
                   "--set", *GPT_FAST, *_train_settings(regime)])
    capsys.readouterr()
    assert status == 0
    (build,) = gpt_builds
    assert_is_the_regime(build["model"], regime)
    _assert_learning_rates(build, _kind(regime))


def test_compare_bert_builds_each_regime_as_named(monkeypatch, tmp_path, capsys):
    models: List[nn.Module] = []

    def build_model(self, config):
        models.append(real_build_model(self, config))
        return models[-1]

    real_build_model = MaskedLM.build_model
    monkeypatch.setattr(MaskedLM, "build_model", build_model)
    status = main(["compare", "--model", "bert", "--regimes", *BERT_REGIMES, "--seeds", "1",
                   "--set", *BERT_FAST, "--run-dir", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert status == 0
    assert len(models) == len(BERT_REGIMES)  # one run each, in the order asked
    built = dict(zip(BERT_REGIMES, models))
    defaults = mlm.MLMConfig().learning_rates
    plain_rate, unit_rate = defaults["fp32"], defaults["unit-fp32"]
    assert plain_rate != unit_rate
    names = {"plain": "plain", "unit": "unit-scaled"}
    for regime, model in built.items():
        assert_is_the_regime(model, regime)
        # The rate the run trained at (no warmup: step 1 is at the peak) is its kind's.
        expected = plain_rate if _kind(regime) == "plain" else unit_rate
        metrics = (tmp_path / f"{regime}-seed0" / "metrics.csv").read_text().splitlines()
        assert float(metrics[1].split(",")[1]) == expected, regime
        summary = json.loads((tmp_path / f"{regime}-seed0" / "summary.json").read_text())
        assert summary["model"] == _kind(regime) and summary["learning_rate"] == expected
        assert f"| {regime} | {names[_kind(regime)]} |" in out


@pytest.mark.parametrize("regime", [r for r in REGIMES if r not in BERT_REGIMES])
def test_compare_bert_refuses_umup_regimes_in_one_line(regime, tmp_path, capsys):
    status = main(["compare", "--model", "bert", "--regimes", "fp32", regime, "--set",
                   *BERT_FAST, "--run-dir", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and f"cannot run {regime}" in err and "u-μP" in err
    assert not (tmp_path / "run").exists()  # refused before anything trains


def test_a_bert_run_without_its_model_kind_is_trained_again(tmp_path, capsys):
    """A finished run whose summary does not say which model it trained (as the build that
    trained every regime unit-scaled wrote them) is not reused."""
    config = mlm.MLMConfig().with_overrides(BERT_FAST)
    mlm.run_mlm_compare(config, ["fp32"], [0], tmp_path, quiet=True)
    summary_path = tmp_path / "fp32-seed0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    assert summary["model"] == "plain"
    del summary["model"]
    summary_path.write_text(json.dumps(summary))
    mlm.run_mlm_compare(config, ["fp32"], [0], tmp_path)
    out = capsys.readouterr().out
    assert "reusing" not in out
    assert json.loads(summary_path.read_text())["model"] == "plain"
