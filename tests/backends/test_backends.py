"""Backend choice and the config -> poptorch.Options mapping, checked on the PopTorch
stand-in (no hand-written poptorch)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ipu_unit_scaling import backends
from ipu_unit_scaling.backends import BACKEND_ENV, BackendError, select_backend
from ipu_unit_scaling.backends.poptorch.poptorch_options import (
    New,
    OptionCall,
    Ref,
    apply_option_calls,
    option_calls,
)
from ipu_unit_scaling.backends.poptorch_backend import poptorch_module
from ipu_unit_scaling.training.run_config import load_config


@pytest.fixture
def standin():
    """The PopTorch stand-in, as the emulator backend passes it (not installed as poptorch)."""
    return poptorch_module("emulator")


def _found(kind, standin, monkeypatch):
    """What ``import poptorch`` finds: nothing, PopTorch without IPUs, or with IPUs."""
    if kind == "none":
        return None
    monkeypatch.setattr(standin, "ipuHardwareIsAvailable",
                        lambda num_ipus=1: kind == "hardware")
    return standin


@pytest.mark.parametrize("kind,expected", [
    ("none", "cpu"), ("no-hardware", "ipu_model"), ("hardware", "ipu"),
])
def test_auto_prefers_hardware_then_ipu_model_then_cpu(monkeypatch, standin, kind, expected):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    found = _found(kind, standin, monkeypatch)
    monkeypatch.setattr(backends, "_import_poptorch", lambda: found)
    assert select_backend("auto") == expected
    assert select_backend("cpu") == "cpu"


def test_environment_variable_overrides(monkeypatch, standin):
    found = _found("hardware", standin, monkeypatch)
    monkeypatch.setattr(backends, "_import_poptorch", lambda: found)
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    assert select_backend("ipu") == "cpu"
    monkeypatch.setenv(BACKEND_ENV, "tpu")
    with pytest.raises(BackendError, match="allowed: auto, ipu, ipu_model, emulator, cpu"):
        select_backend("auto")


def test_asking_for_ipu_without_poptorch_says_why(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "poptorch", None)  # `import poptorch` fails
    with pytest.raises(BackendError, match="needs PopTorch"):
        select_backend("ipu_model")


def test_package_imports_without_poptorch():
    # A poptorch that fails to import must not break the package, nor be imported eagerly.
    code = (
        "import sys; sys.modules['poptorch'] = None\n"
        "import ipu_unit_scaling, ipu_unit_scaling.backends, ipu_unit_scaling.ipu\n"
        "import ipu_unit_scaling.backends.poptorch.poptorch_training\n"
        "import ipu_unit_scaling.backends.standin_op_library\n"
        "import ipu_unit_scaling.backends.poptorch.poptorch_options\n"
        "import ipu_unit_scaling.backends.distributed\n"
        "from ipu_unit_scaling.backends import select_backend\n"
        "assert select_backend('auto') == 'cpu'\n"
    )
    env_free = {k: v for k, v in __import__("os").environ.items() if k != BACKEND_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, env=env_free)


def test_four_ipu_config_maps_to_these_option_calls():
    calls = option_calls(load_config("ipu-4").ipu)
    assert calls == [
        OptionCall("deviceIterations", (4,)),
        OptionCall("replicationFactor", (2,)),
        OptionCall("Training.gradientAccumulation", (16,)),
        OptionCall("Training.accumulationAndReplicationReductionType",
                   (Ref("ReductionType.Mean"),)),
        OptionCall("outputMode", (Ref("OutputMode.All"),)),
        OptionCall("setAvailableMemoryProportion",
                   ({"IPU0": 0.2, "IPU1": 0.4, "IPU2": 0.4, "IPU3": 0.4},)),
        OptionCall("Precision.setPartialsType", (Ref("float", module="torch"),)),
        OptionCall("Precision.enableStochasticRounding", (False,)),
        OptionCall("enableExecutableCaching", ("./exe_cache",)),
        OptionCall("setExecutionStrategy",
                   (New("PipelinedExecution", (Ref("AutoStage.AutoIncrement"),)),)),
    ]


def test_single_ipu_options_are_not_pipelined():
    config = load_config(None, ["ipu.partials_type=half", "ipu.stochastic_rounding=true",
                                "ipu.available_memory_proportion=0.3"])
    calls = {call.method: call.args for call in option_calls(config.ipu, use_ipu_model=True)}
    assert "setExecutionStrategy" not in calls and "enableExecutableCaching" not in calls
    assert calls["Precision.setPartialsType"] == (Ref("half", module="torch"),)
    assert calls["Precision.enableStochasticRounding"] == (True,)
    assert calls["setAvailableMemoryProportion"] == ({"IPU0": 0.3},)
    assert calls["useIpuModel"] == (True,)


def test_calls_apply_through_getattr_chains_with_resolved_arguments(standin):
    calls = option_calls(load_config("ipu-4").ipu)
    options = apply_option_calls(standin.Options(), calls, standin)
    assert isinstance(options, standin.Options)
    assert options.device_iterations == 4 and options.replication_factor == 2
    assert options.Training.gradient_accumulation == 16
    assert options.Training.accumulation_and_replication_reduction_type == (
        standin.ReductionType.Mean)
    assert standin.OutputMode(options.output_mode) == standin.OutputMode.All
    assert options.available_memory_proportion == {0: 0.2, 1: 0.4, 2: 0.4, 3: 0.4}
    popart = options._Popart.options
    assert popart["partialsTypeMatMuls"] == "float"  # torch.float, resolved from Ref
    assert popart["enableStochasticRounding"] is False
    assert popart["cachePath"] == "./exe_cache" and popart["enableEngineCaching"] is True
    strategy = options._execution_strategy
    assert type(strategy) is standin.PipelinedExecution
    assert strategy._stages_manager._auto_stage == standin.AutoStage.AutoIncrement
    assert options.toDict()["execution_mode"] == 0  # pipelined, as PopTorch's backend reads


def test_half_partials_and_the_ipu_model_reach_the_options(standin):
    config = load_config(None, ["ipu.partials_type=half", "ipu.stochastic_rounding=true"])
    options = apply_option_calls(standin.Options(), option_calls(config.ipu, use_ipu_model=True),
                                 standin)
    assert options._Popart.options["partialsTypeMatMuls"] == "half"
    assert options._Popart.options["enableStochasticRounding"] is True
    assert options.use_model is True


def test_popxl_backend_needs_popxl(monkeypatch):
    monkeypatch.setitem(sys.modules, "popxl", None)
    with pytest.raises(BackendError, match="'popxl' needs PopXL"):
        select_backend("popxl")


def test_inference_model_on_cpu_and_emulator_gives_the_eval_logits(standin):
    from ipu_unit_scaling import GPT
    from ipu_unit_scaling.backends import build_inference_model
    from ipu_unit_scaling.ops.ipu_lowering import torch_numerics

    torch.manual_seed(0)
    model = GPT(vocab_size=16, hidden_size=8, depth=2, heads=2, seq_len=6,
                               dropout_p=0.5)
    ids = torch.randint(0, 16, (3, 6))
    config = load_config("tiny")
    model.train()
    cpu = build_inference_model(model, config, backend="cpu")(ids)
    assert not model.training  # evaluation switches dropout off
    expected = model(ids)
    assert torch.equal(cpu, expected) and not cpu.requires_grad
    model.train()
    runner = build_inference_model(model, config, backend="emulator")
    with torch_numerics():  # GELU as torch defines it (an IPU runs PopART's; test_ipu_lowering.py)
        emulated = runner(ids)
    assert torch.allclose(emulated, expected, rtol=1e-5, atol=1e-6)
    # The IPU backend's inference model, run by the stand-in's poptorch.inferenceModel.
    from ipu_unit_scaling.backends.poptorch.poptorch_training import IPUInferenceModel

    assert isinstance(runner, IPUInferenceModel)
    assert isinstance(runner.executor, standin.PoplarExecutor) and not runner.executor.training
