"""Backends as objects: the registry, the built-in backends' capabilities, and a backend added
by registering one object, trained through the training loop."""
from __future__ import annotations

import math
from typing import Any, List

import pytest
import torch
from torch import nn

from ipu_unit_scaling.backends import BACKEND_ENV, BackendError, select_backend
from ipu_unit_scaling.backends.cpu import CPUTrainingModel, TrainingModule
from ipu_unit_scaling.backends.registry import (
    BUILTIN,
    Capabilities,
    TrainingBackend,
    backend_named,
    register,
    registered_names,
    unregister,
)
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.config_files import ConfigError
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_records import read_metrics


def test_the_builtin_backends_are_registered_under_their_names():
    assert set(BUILTIN) == {"ipu", "ipu_model", "emulator", "cpu", "popxl", "distributed"}
    for name in BUILTIN:
        assert backend_named(name).name == name
        assert load_config("tiny", [f"backend={name}"]).backend == name


def test_a_config_refuses_what_cannot_be_a_backends_name():
    with pytest.raises(ConfigError, match="backend: got 'CPU!'; a backend's name is lowercase"):
        load_config("tiny", ["backend=CPU!"])


def test_capabilities_say_what_each_backend_can_do():
    on_device = {n for n in BUILTIN if backend_named(n).capabilities.activations_on_device}
    assert on_device == {"ipu", "popxl"}
    assert {n for n in BUILTIN if not backend_named(n).capabilities.trains_given_model} == {
        "popxl", "distributed"}
    assert {n for n in BUILTIN if not backend_named(n).capabilities.trains_masked_lm} == {
        "popxl"}
    assert {n for n in BUILTIN if backend_named(n).capabilities.spans_processes} == {
        "distributed"}


def test_an_unknown_backend_is_refused_with_the_known_ones():
    with pytest.raises(BackendError, match="'nowhere' unknown; allowed: auto, ipu, ipu_model"):
        backend_named("nowhere")


class CountedCPUTrainingModel(CPUTrainingModel):
    def __init__(self, *args: Any, calls: List[int], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.calls = calls

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Any:
        self.calls.append(int(inputs.shape[0]))
        return super().__call__(inputs, labels)


class HalvingBackend(TrainingBackend):
    """A toy backend: the CPU's training model stepping plain SGD at half the configured
    learning rate, counting its calls."""

    name = "halving"
    capabilities = Capabilities()

    def __init__(self) -> None:
        self.calls: List[int] = []

    def make_optimizer(self, parameters: Any, training: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=training.learning_rate / 2)

    def build_training_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             config: Config) -> Any:
        return CountedCPUTrainingModel(TrainingModule(model), optimizer, calls=self.calls,
                                       device_iterations=config.ipu.device_iterations)


def test_a_registered_backend_trains_through_the_loop(tmp_path, monkeypatch):
    toy = register(HalvingBackend())
    try:
        assert "halving" in registered_names()
        monkeypatch.setenv(BACKEND_ENV, "halving")
        assert select_backend("auto") == "halving"
        monkeypatch.delenv(BACKEND_ENV)
        # the config names it as it names a built-in one
        config = load_config("tiny", ["training.steps=4", "training.optimizer=sgd",
                                      "ipu.executable_cache_dir=null", "backend=halving"])
        summary = train(config, tmp_path / "run", quiet=True, log=lambda _: None)
    finally:
        unregister("halving")
    assert len(toy.calls) == 4 // config.ipu.device_iterations
    assert all(rows == config.samples_per_call for rows in toy.calls)
    metrics = read_metrics(tmp_path / "run")
    assert [int(row["step"]) for row in metrics] == [1, 2, 3, 4] and summary is not None
    assert all(math.isfinite(float(row["train_loss"])) for row in metrics)
    assert "halving" not in registered_names()


def test_the_backends_models_are_built_from_config_sections_not_the_whole_config():
    """The training models and what they are made of take the sections they read; only a
    backend object's factories receive the whole Config, to hand them on."""
    import inspect
    import re

    from ipu_unit_scaling.backends.distributed import DataParallelReplica, DistributedTrainingModel
    from ipu_unit_scaling.backends.pipeline import PipelineReplica
    from ipu_unit_scaling.backends.pipeline_stages import ipu_stages
    from ipu_unit_scaling.backends.poptorch.poptorch_training import (
        IPUInferenceModel,
        IPUTrainingModel,
    )
    from ipu_unit_scaling.backends.popxl import PopXLTrainingModel

    built = [CPUTrainingModel, DistributedTrainingModel, DataParallelReplica, PipelineReplica,
             PopXLTrainingModel, IPUTrainingModel, IPUInferenceModel, ipu_stages]
    whole = []
    for thing in built:
        for parameter in inspect.signature(thing).parameters.values():
            if re.search(r"\bConfig\b", str(parameter.annotation)):
                whole.append(f"{thing.__name__}({parameter.name})")
    assert not whole, f"built from the whole Config: {whole}"
    # the check sees a whole Config where there is one
    factory = inspect.signature(TrainingBackend.build_training_model).parameters["config"]
    assert re.search(r"\bConfig\b", str(factory.annotation))
