"""The IPU system the PopTorch stand-in reports under ``ipu-unit-scaling emulate``
(:mod:`ipu_standins.emulated_system`): devices of every power of two of IPUs up to the
emulated count, version 2 (Mk2), none where the count is unset or 0 or where PopTorch's IPU
Model variables hide the hardware (popart_compiler's ``ipuHardwareVersion``), and one-line
refusals of a count that no IPU system has."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins import emulated_system
from ipu_standins.emulated_system import EMULATED_IPUS_ENV, describe, parse_ipu_count
from ipu_standins.poptorch import poptorch_core


@pytest.fixture
def pod16(monkeypatch):
    for name in ("POPTORCH_IPU_MODEL", "POPTORCH_SMALL_IPU_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(EMULATED_IPUS_ENV, "16")


def test_an_emulated_pod16_has_devices_of_each_power_of_two_up_to_16(pod16):
    available = {n: poptorch.ipuHardwareIsAvailable(n) for n in range(0, 33)}
    assert [n for n, yes in available.items() if yes] == [1, 2, 4, 8, 16]
    assert poptorch.ipuHardwareIsAvailable()  # one IPU, PopTorch's default
    assert poptorch.ipuHardwareVersion() == 2
    assert poptorch_core.ipuHardwareVersion(numIpus=8) == 2
    assert poptorch_core.ipuHardwareVersion(numIpus=32) == 0


def test_the_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(EMULATED_IPUS_ENV, "4")
    assert poptorch.ipuHardwareIsAvailable(4) and not poptorch.ipuHardwareIsAvailable(8)
    monkeypatch.setenv(EMULATED_IPUS_ENV, "0")
    assert not poptorch.ipuHardwareIsAvailable()
    monkeypatch.delenv(EMULATED_IPUS_ENV)
    assert not poptorch.ipuHardwareIsAvailable()
    monkeypatch.setenv(EMULATED_IPUS_ENV, "6")
    with pytest.raises(ValueError, match="a power of two from 1 to 1024, not '6'"):
        poptorch.ipuHardwareIsAvailable()


@pytest.mark.parametrize("variable", ["POPTORCH_IPU_MODEL", "POPTORCH_SMALL_IPU_MODEL"])
def test_poptorch_s_ipu_model_variables_hide_the_hardware(pod16, monkeypatch, variable):
    monkeypatch.setenv(variable, "1")
    assert not poptorch.ipuHardwareIsAvailable()
    assert poptorch_core.ipuHardwareVersion() == 0
    monkeypatch.setenv(variable, "0")
    assert poptorch.ipuHardwareIsAvailable()


@pytest.mark.parametrize("text", ["3", "-1", "2048", "many", "1.5", " "])
def test_counts_no_ipu_system_has_are_refused_in_one_line(text):
    with pytest.raises(ValueError) as refused:
        parse_ipu_count(text, "--ipus")
    message = str(refused.value)
    assert message.startswith("--ipus must be 0 (no IPU system) or a power of two")
    assert "\n" not in message and repr(text) in message


def test_the_system_in_words():
    assert describe(16) == "an IPU-POD16 (16 Mk2 IPUs)"
    assert describe(64) == "an IPU-POD64 (64 Mk2 IPUs)"
    assert describe(2) == "a system of 2 Mk2 IPUs"
    assert describe(1) == "a system of 1 Mk2 IPU"
    assert emulated_system.device_available(2, {EMULATED_IPUS_ENV: "2"})
    assert not emulated_system.device_available(2, {})


def test_use_ipu_model_keeps_its_meaning_on_the_emulated_system(pod16):
    """``useIpuModel(True)`` runs on the IPU Model even where hardware is present, as in
    PopTorch: the GELU gradient is the IPU Model's (the exact derivative of the tanh form),
    not hardware's (popnn's assembly codelet)."""
    w = torch.linspace(-3, 3, 13)
    slopes = {}
    for use_model in (False, True):
        model = _Gelu(w)
        opts = poptorch.Options().useIpuModel(use_model)
        poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1.0))(
            torch.ones(1))
        slopes[use_model] = w - model.w.detach()
    v = w.clone().requires_grad_()
    torch.nn.functional.gelu(v, approximate="tanh").sum().backward()
    # One SGD step of lr 1 in float32: a few ulps of |w| <= 3 (2**-21 = 4.8e-7 per ulp).
    torch.testing.assert_close(slopes[True], v.grad, rtol=0, atol=4e-6)
    assert (slopes[False] - v.grad).abs().max() > 100 * 4e-6


class _Gelu(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return poptorch.identity_loss(torch.nn.functional.gelu(self.w * x), reduction="sum")
