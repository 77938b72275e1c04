"""``popxl``: the unit-scaled GPT written in PopXL, with real FP8 matmuls (:mod:`.popxl`).

Its programs are for training: evaluation and sampling run eager PyTorch on the host. It trains
the GPT it writes in PopXL, not a given model nor the masked LM's encoder.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..training.run_config import Config
from .backend_error import BackendError
from .registry import Capabilities, TrainingBackend

__all__ = ["PopXLBackend", "POPXL_BACKEND"]


class PopXLBackend(TrainingBackend):
    name = "popxl"
    capabilities = Capabilities(activations_on_device=True, trains_given_model=False,
                                trains_masked_lm=False, traces_the_model=True)

    def check_available(self) -> None:
        from .popxl import popxl_available

        if not popxl_available():
            raise BackendError(
                "backend 'popxl' needs PopXL (the Poplar SDK's popxl), which does not import "
                "here; use 'emulator', 'cpu' or 'auto', or unset IPU_UNIT_SCALING_BACKEND")

    def build_training_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             config: Config) -> Any:
        from .popxl import PopXLTrainingModel, check_config

        check_config(config)  # every key it does not build, the model's among them, at once
        return PopXLTrainingModel(model, optimizer, training=config.training,
                                  precision=config.precision, ipu=config.ipu)


POPXL_BACKEND = PopXLBackend()
