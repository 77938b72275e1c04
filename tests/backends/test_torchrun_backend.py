"""torchrun's data-parallel and pipelined runs: two backend objects under the name
``distributed``, the config's layout choosing between them. The runs themselves, under
torchrun, are in test_distributed.py."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from helpers import DATA_PARALLEL
from torch import nn

import ipu_unit_scaling.backends.pipeline as pipeline_module
from ipu_unit_scaling.backends import build_training_model, capabilities, make_optimizer
from ipu_unit_scaling.backends import torchrun_backend as torchrun
from ipu_unit_scaling.backends.distributed import DistributedTrainingModel
from ipu_unit_scaling.backends.pipeline_stages import ipu_stages
from ipu_unit_scaling.backends.registry import Capabilities, backend_named, registered_names
from ipu_unit_scaling.backends.torchrun_backend import (
    DATA_PARALLEL_RUN,
    PIPELINED_RUN,
    TORCHRUN_BACKEND,
    DataParallelRun,
    PipelinedRun,
)
from ipu_unit_scaling.training.precision import build_model
from ipu_unit_scaling.training.run_config import load_config

PIPELINED_CONFIG = ["ipu.replication_factor=2"]  # configs/tiny.yaml: two stages


def test_the_layout_chooses_the_run_the_name_stands_for():
    data_parallel = load_config("tiny", DATA_PARALLEL)
    pipelined = load_config("tiny", PIPELINED_CONFIG)
    assert pipelined.ipu.ipus_per_replica == 2 and data_parallel.ipu.ipus_per_replica == 1
    assert isinstance(DATA_PARALLEL_RUN, DataParallelRun)
    assert isinstance(PIPELINED_RUN, PipelinedRun)
    assert backend_named("distributed", data_parallel.ipu) is DATA_PARALLEL_RUN
    assert backend_named("distributed", pipelined.ipu) is PIPELINED_RUN
    assert backend_named("distributed") is TORCHRUN_BACKEND
    # one name, as configs, summaries and messages give it
    assert DATA_PARALLEL_RUN.name == PIPELINED_RUN.name == TORCHRUN_BACKEND.name == "distributed"
    assert registered_names().count("distributed") == 1
    # a name that stands for one object gives it whatever the layout
    assert backend_named("cpu", pipelined.ipu) is backend_named("cpu")


def test_each_run_carries_its_own_capabilities():
    pipelined = load_config("tiny", PIPELINED_CONFIG).ipu
    data_parallel = load_config("tiny", DATA_PARALLEL).ipu
    assert capabilities("distributed", pipelined) is PIPELINED_RUN.capabilities
    assert capabilities("distributed", data_parallel) is DATA_PARALLEL_RUN.capabilities
    for run in (DATA_PARALLEL_RUN, PIPELINED_RUN):
        assert run.capabilities.spans_processes and not run.capabilities.trains_given_model
        assert not run.capabilities.traces_the_model
    # without a layout, the name can do what both runs can
    assert TORCHRUN_BACKEND.capabilities == Capabilities(trains_given_model=False,
                                                         spans_processes=True)


class RecordedRunner:
    """A replica runner that records how the run built it."""

    def __init__(self, *args: Any) -> None:
        self.args = args


@pytest.fixture
def built_runners(monkeypatch) -> List[RecordedRunner]:
    """The runners torchrun's runs build, recorded in place of the ones that need a world."""
    built: List[RecordedRunner] = []

    def record(*args: Any) -> RecordedRunner:
        built.append(RecordedRunner(*args))
        return built[-1]

    monkeypatch.setattr(torchrun, "check_launch", lambda ipu: None)
    monkeypatch.setattr(torchrun, "DataParallelReplica", record)
    monkeypatch.setattr(pipeline_module, "PipelineReplica", record)
    return built


def _wrapper(config_overrides: List[str]) -> Dict[str, Any]:
    config = load_config("tiny", config_overrides + ["backend=distributed"])
    torch.manual_seed(0)
    model = build_model(config)
    optimizer = make_optimizer(model, config, "distributed")
    wrapper = build_training_model(model, optimizer, config, "distributed")
    assert isinstance(wrapper, DistributedTrainingModel)
    return dict(config=config, model=model, wrapper=wrapper)


def test_the_data_parallel_run_builds_a_replica_of_the_whole_model(built_runners):
    built = _wrapper(DATA_PARALLEL)
    config, model = built["config"], built["model"]
    [runner] = built_runners
    assert runner.args == (model, config.ipu.gradient_accumulation)
    assert built["wrapper"]._runner is runner
    assert built["wrapper"].stages == ipu_stages(model, config.ipu)


def test_the_pipelined_run_builds_this_ranks_stage(built_runners):
    built = _wrapper(PIPELINED_CONFIG)
    config, model = built["config"], built["model"]
    [runner] = built_runners
    micro_batch = (config.micro_batch_size, config.model.seq_len)
    ipu = config.ipu
    # rank 0 (no world): stage 0 of replica 0
    assert runner.args == (model, ipu_stages(model, ipu), micro_batch, ipu.replication_factor,
                           ipu.gradient_accumulation, 0, 0)
    assert built["wrapper"]._runner is runner


def test_the_name_builds_the_run_of_the_config_it_is_given(built_runners):
    """Asked without a layout, the registered object builds what the layout's run builds."""
    config = load_config("tiny", PIPELINED_CONFIG)
    model: nn.Module = build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    TORCHRUN_BACKEND.build_training_model(model, optimizer, config)
    assert len(built_runners[0].args) == 7  # PipelineReplica's
    config = load_config("tiny", DATA_PARALLEL)
    TORCHRUN_BACKEND.build_training_model(model, optimizer, config)
    assert len(built_runners[1].args) == 2  # DataParallelReplica's
