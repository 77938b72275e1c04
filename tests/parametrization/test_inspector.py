"""The u-μP inspector: every parameter once with the learning rate its optimizer applies, u-μP's
ratios between roles as the rules define them, and a wrong multiplier flagged."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import ROOT

from ipu_unit_scaling.apps.health import inspect_config
from ipu_unit_scaling.backends import make_optimizer
from ipu_unit_scaling.optim import LR_SCALE
from ipu_unit_scaling.parametrization.inspector import (
    OUTLIER_FACTOR,
    inspect_parameters,
    parameter_roles,
)
from ipu_unit_scaling.parametrization.mup_optimizers import set_learning_rate
from ipu_unit_scaling.training.precision import build_model
from ipu_unit_scaling.training.run_config import load_config

UMUP = ["model.parametrization=u-mup", "training.learning_rate=0.5"]
FACTORY = ["ipu.ipus_per_replica=1", "ipu.layers_per_ipu=[-1]",
           "model.factory=examples.library_decoder:build", "model.vocab_size=24",
           "model.seq_len=16", "model.parametrization=u-mup", "precision.dtype=fp32"]


def _reports(overrides, lr=0.5):
    config = load_config("tiny", overrides)
    torch.manual_seed(0)
    model = build_model(config)
    optimizer = make_optimizer(model, config, "cpu")
    set_learning_rate(optimizer, lr)
    return model, optimizer, inspect_parameters(model, optimizer, lr)


@pytest.mark.parametrize("overrides", [[], UMUP, FACTORY], ids=["gpt", "u-mup", "factory"])
def test_every_trainable_parameter_once_with_a_finite_learning_rate(overrides, monkeypatch):
    monkeypatch.chdir(ROOT)  # the factory's module is found from the repository root
    model, _, reports = _reports(overrides)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert [r.name for r in reports] == names
    assert all(math.isfinite(r.learning_rate) and r.learning_rate > 0 for r in reports)
    assert all(r.role != "other" for r in reports)
    if overrides:  # u-μP: the model's factors are the rules', so nothing is flagged
        assert not [r.name for r in reports if r.flags]


def test_the_rules_ratios_between_roles():
    model, _, reports = _reports(UMUP)
    by_name = {r.name: r for r in reports}
    depth = len(model.layers)
    hidden = by_name["layers.0.mlp.up.weight"]
    down = by_name["layers.0.mlp.down.weight"]
    norm = by_name["layers.0.attn_norm.weight"]
    embedding = by_name["embedding.weight"]
    output = by_name["head.weight"]
    fan_in_up, fan_in_down = hidden.shape[1], down.shape[1]
    # hidden: fan_in**-0.5 * depth**-0.5; norm: depth**-0.5; output: 1; embedding: width**-0.5
    assert hidden.learning_rate / output.learning_rate == pytest.approx(
        fan_in_up ** -0.5 * depth ** -0.5, rel=1e-12)
    assert down.learning_rate / hidden.learning_rate == pytest.approx(
        (fan_in_down / fan_in_up) ** -0.5, rel=1e-12)
    assert norm.learning_rate / output.learning_rate == pytest.approx(depth ** -0.5, rel=1e-12)
    assert embedding.learning_rate / output.learning_rate == pytest.approx(
        embedding.shape[1] ** -0.5, rel=1e-12)
    assert {r.role for r in reports} == {"embedding", "hidden", "norm", "output"}


def test_a_wrong_multiplier_is_flagged_and_only_it():
    config = load_config("tiny", UMUP)
    torch.manual_seed(0)
    model = build_model(config)
    optimizer = make_optimizer(model, config, "cpu")
    target = model.layers[1].mlp.up.weight
    for group in optimizer.param_groups:  # one tensor moved to a group of its own at 8x
        if any(p is target for p in group["params"]):
            group["params"] = [p for p in group["params"] if p is not target]
            optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                       "params": [target], LR_SCALE: group[LR_SCALE] * 8})
            break
    set_learning_rate(optimizer, 0.5)
    reports = inspect_parameters(model, optimizer, 0.5)
    flagged = [r.name for r in reports if r.flags]
    assert flagged == ["layers.1.mlp.up.weight"]
    assert "not u-μP's" in " ".join(reports[[r.name for r in reports].index(flagged[0])].flags)


def test_a_measured_update_ratio_far_from_its_role_is_flagged():
    model, optimizer, _ = _reports([])
    ratios = {name: 0.01 for name, _ in model.named_parameters()}
    ratios["layers.0.attn.proj.weight"] = 0.01 * OUTLIER_FACTOR * 2
    reports = inspect_parameters(model, optimizer, 0.5, ratios)
    assert [r.name for r in reports if r.flags] == ["layers.0.attn.proj.weight"]


def test_roles_of_a_model_u_mup_cannot_type_are_other():
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 3), torch.nn.Linear(2, 2))
    assert parameter_roles(model) == {"0.weight": "other", "0.bias": "other",
                                      "1.weight": "other", "1.bias": "other"}


def test_inspect_config_prints_a_row_per_parameter_and_the_step(monkeypatch):
    config = load_config("tiny", UMUP)
    text = inspect_config(config, step=3)
    assert text.startswith(f"{len(list(build_model(config).parameters()))} parameters at step 3")
    assert "layers.1.mlp.down.weight" in text and "0 flagged" in text.splitlines()[0]
