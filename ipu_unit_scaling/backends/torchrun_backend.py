"""torchrun's two runs as backends: the data-parallel run and the pipelined run.

Both are named ``distributed``, the name a config gives them: the config's layout says which
one trains it. With one IPU per replica (``ipu.ipus_per_replica: 1``) every process holds a
replica of the whole model (:data:`DATA_PARALLEL_RUN`); with several, each process runs one
pipeline stage of one replica (:data:`PIPELINED_RUN`). :data:`TORCHRUN_BACKEND` is what the
registry holds under the name, and gives the run of a layout (:meth:`TorchrunBackend.for_layout`).
What the processes share (the world, rank 0's run directory, the training model's call) is in
:mod:`.distributed`; the pipeline's stages are in :mod:`.pipeline`.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Sequence, Tuple

import torch
from torch import nn

from ..training.run_config import Config, IPUConfig
from .distributed import (
    DataParallelReplica,
    DistributedTrainingModel,
    ReplicaRunner,
    check_launch,
    rank_place,
)
from .pipeline_stages import Stage, ipu_stages
from .registry import Capabilities, InferenceModel, TrainingBackend

__all__ = ["TorchrunRun", "DataParallelRun", "PipelinedRun", "TorchrunBackend",
           "DATA_PARALLEL_RUN", "PIPELINED_RUN", "TORCHRUN_BACKEND"]

NAME = "distributed"


class TorchrunRun(TrainingBackend):
    """One of torchrun's runs: one process per stage and replica of the config's layout
    (:class:`~ipu_unit_scaling.backends.distributed.DistributedTrainingModel`); its ranks
    evaluate alike, in eager PyTorch. A subclass says how a rank runs its share of a step."""

    name = NAME

    def runs_layout(self, ipu: IPUConfig) -> bool:
        """Whether this run trains ``ipu``'s layout."""
        raise NotImplementedError

    def replica_runner(self, model: nn.Module, split: Sequence[Stage], ipu: IPUConfig,
                       micro_batch: Tuple[int, int]) -> ReplicaRunner:
        """This rank's share of a step, in a world already checked against ``ipu``."""
        raise NotImplementedError

    def build_training_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             config: Config) -> DistributedTrainingModel:
        ipu = config.ipu
        check_launch(ipu)
        split = ipu_stages(model, ipu)
        runner = self.replica_runner(model, split, ipu,
                                     (config.micro_batch_size, config.model.seq_len))
        return DistributedTrainingModel(model, optimizer, ipu, runner, split,
                                        grad_clip=config.training.grad_clip,
                                        dropout=config.model.dropout)


class DataParallelRun(TorchrunRun):
    """Replicas of the whole model, ``DistributedDataParallel`` between the processes. It
    trains the GPT of the config, as the pipelined run does."""

    capabilities = Capabilities(trains_given_model=False, spans_processes=True)

    def runs_layout(self, ipu: IPUConfig) -> bool:
        return ipu.ipus_per_replica == 1

    def replica_runner(self, model: nn.Module, split: Sequence[Stage], ipu: IPUConfig,
                       micro_batch: Tuple[int, int]) -> ReplicaRunner:
        return DataParallelReplica(model, ipu.gradient_accumulation)


class PipelinedRun(TorchrunRun):
    """The stages of ``ipu.layers_per_ipu`` as ``torch.distributed.pipelining`` stages, one
    process each, replicas of a stage ``DistributedDataParallel``. It splits the GPT's layer
    list, so it trains no given model."""

    capabilities = Capabilities(trains_given_model=False, spans_processes=True)

    def runs_layout(self, ipu: IPUConfig) -> bool:
        return ipu.ipus_per_replica > 1

    def replica_runner(self, model: nn.Module, split: Sequence[Stage], ipu: IPUConfig,
                       micro_batch: Tuple[int, int]) -> ReplicaRunner:
        from .pipeline import PipelineReplica

        replica, stage = rank_place(ipu)
        return PipelineReplica(model, list(split), micro_batch, ipu.replication_factor,
                               ipu.gradient_accumulation, replica, stage)


DATA_PARALLEL_RUN = DataParallelRun()
PIPELINED_RUN = PipelinedRun()
RUNS: Tuple[TorchrunRun, ...] = (DATA_PARALLEL_RUN, PIPELINED_RUN)


def _shared(runs: Sequence[TrainingBackend]) -> Capabilities:
    """What every one of ``runs`` can do."""
    return Capabilities(**{field.name: all(getattr(run.capabilities, field.name) for run in runs)
                           for field in fields(Capabilities)})


class TorchrunBackend(TrainingBackend):
    """``distributed``: the name of torchrun's runs, registered once. Asked with a layout it
    gives the run that trains it; asked without one, its capabilities are those both runs
    have, and it builds the training and inference models of the run of the config it is
    given."""

    name = NAME
    capabilities = _shared(RUNS)

    def for_layout(self, ipu: IPUConfig) -> TorchrunRun:
        return next(run for run in RUNS if run.runs_layout(ipu))

    def build_training_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             config: Config) -> DistributedTrainingModel:
        return self.for_layout(config.ipu).build_training_model(model, optimizer, config)

    def build_inference_model(self, model: nn.Module, config: Config) -> InferenceModel:
        return self.for_layout(config.ipu).build_inference_model(model, config)


TORCHRUN_BACKEND = TorchrunBackend()
