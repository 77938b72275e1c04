"""The u-μP optimizers: per-parameter learning rates equal the rules, independent weight decay.

Expected learning rates are written out from the published rules (u-μP paper, sections 3-4;
``unit_scaling/optim.py: lr_scale_func_adam``): embedding eta/sqrt(width), hidden weights
eta/sqrt(fan_in), readout, norms and biases eta, everything inside the L residual blocks
times 1/sqrt(L).
"""
from __future__ import annotations

import math
from typing import Dict

import pytest
import torch

from ipu_unit_scaling import optim
from ipu_unit_scaling.models import umup_decoder
from ipu_unit_scaling.parametrization.umup import UmupHyperparameters

WIDTH, DEPTH, EXPANSION, VOCAB, SEQ = 64, 3, 4, 40, 16


def gpt(bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return umup_decoder(VOCAB, WIDTH, DEPTH, 4, SEQ, mlp_expansion=EXPANSION, bias=bias,
                        hyperparameters=UmupHyperparameters())


def expected_rate(name: str, eta: float) -> float:
    in_blocks = name.startswith("layers.")
    depth = DEPTH**-0.5 if in_blocks else 1.0
    if name.endswith("embedding.weight"):
        return eta / math.sqrt(WIDTH)
    if name.endswith("mlp.down.weight"):
        return eta / math.sqrt(EXPANSION * WIDTH) * depth
    if name.endswith(("qkv.weight", "proj.weight", "up.weight")):
        return eta / math.sqrt(WIDTH) * depth
    return eta * depth  # the readout, norm gains and biases


def rates(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Dict[str, float]:
    by_id = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW, optim.SGD])
@pytest.mark.parametrize("bias", [False, True])
def test_every_parameter_gets_the_rate_the_rules_give(cls, bias):
    model = gpt(bias)
    optimizer = cls(model, lr=2.0)
    got = rates(optimizer, model)
    assert len(got) == len(list(model.parameters()))
    for name, rate in got.items():
        assert rate == pytest.approx(expected_rate(name, 2.0), rel=1e-12), name


def test_a_schedule_moves_every_group_together():
    model = gpt()
    optimizer = optim.AdamW(model, lr=2.0)
    optim.set_learning_rate(optimizer, 0.5)
    for name, rate in rates(optimizer, model).items():
        assert rate == pytest.approx(expected_rate(name, 0.5), rel=1e-12), name
    plain = torch.optim.Adam(model.parameters(), lr=1.0)
    optim.set_learning_rate(plain, 0.25)  # groups without a scale take the rate as it is
    assert plain.param_groups[0]["lr"] == 0.25


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD])
def test_weight_decay_is_independent_of_the_learning_rate(cls):
    # With zero gradients a step is pure decay: every weight shrinks by weight_decay times the
    # schedule's fraction of the peak rate, whatever its group's rate.
    model = gpt()
    optimizer = cls(model, lr=4.0, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for old, new in zip(before, model.parameters()):
        torch.testing.assert_close(new.detach(), old * 0.9)
    optim.set_learning_rate(optimizer, 1.0)  # a quarter of the peak rate
    optimizer.step()
    for old, new in zip(before, model.parameters()):
        torch.testing.assert_close(new.detach(), old * 0.9 * (1 - 0.1 / 4))


def test_adam_weight_decay_is_the_l2_term_as_given():
    model = gpt()
    optimizer = optim.Adam(model, lr=4.0, weight_decay=0.1)
    assert {group["weight_decay"] for group in optimizer.param_groups} == {0.1}


def test_groups_are_the_same_every_time_so_checkpoints_load():
    model = gpt()
    first = optim.AdamW(model, lr=1.0)
    model(*torch.randint(0, VOCAB, (2, 2, SEQ))).backward()
    first.step()
    second = optim.AdamW(model, lr=1.0)
    second.load_state_dict(first.state_dict())
    assert [g["lr_scale"] for g in second.param_groups] == \
        [g["lr_scale"] for g in first.param_groups]
    assert len(second.state) == len(list(model.parameters()))


def test_a_subset_of_parameters_gets_the_same_rates():
    # A pipeline stage optimizes only its own layers; their rates do not change.
    model = gpt()
    owned = list(model.layers[1].parameters())
    groups = optim.param_groups(model, 2.0, parameters=owned)
    names = {id(p): name for name, p in model.named_parameters()}
    for group in groups:
        for p in group["params"]:
            assert group["lr"] == pytest.approx(expected_rate(names[id(p)], 2.0))
    assert sum(len(g["params"]) for g in groups) == len(owned)
    with pytest.raises(ValueError, match="not parameters of the model"):
        optim.param_groups(model, 2.0, parameters=[torch.nn.Parameter(torch.ones(2))])


def test_u_mup_trains_with_its_own_optimizer():
    model = gpt()
    optimizer = optim.AdamW(model, lr=1.0)
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, dims=1)
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        loss = model(ids, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_make_optimizer_gives_u_mup_groups_on_every_backend():
    # The IPU backend passes the same groups to poptorch.optim (per-group lr and weight_decay
    # are how PopTorch takes per-parameter hyperparameters); the emulator backend runs that
    # code on the PopTorch stand-in, whose poptorch.optim keeps them.
    from ipu_unit_scaling.backends import make_optimizer
    from ipu_unit_scaling.backends.poptorch_backend import poptorch_module
    from ipu_unit_scaling.training.run_config import load_config

    standin = poptorch_module("emulator")
    config = load_config(None, ["model.parametrization=u-mup", "training.learning_rate=2.0",
                                "training.optimizer=adamw", "training.weight_decay=0.1",
                                "training.grad_clip=1.0"])
    model = gpt()  # the optimizer's rates come from the model; the config gives eta
    names = {id(p): name for name, p in model.named_parameters()}
    cpu = make_optimizer(model, config, "cpu")
    ipu = make_optimizer(model, config, "emulator")
    assert type(cpu) is torch.optim.AdamW and type(ipu) is standin.optim.AdamW
    assert ipu.max_grad_norm == 1.0
    for groups in (cpu.param_groups, ipu.param_groups):
        assert sum(len(g["params"]) for g in groups) == len(names)
        for group in groups:
            assert group["weight_decay"] == pytest.approx(0.1 / group["lr"])
            for p in group["params"]:
                assert group["lr"] == pytest.approx(expected_rate(names[id(p)], 2.0))
    with pytest.raises(TypeError, match="model"):
        make_optimizer(model.parameters(), config, "cpu")
