"""The backends that run the IPU backend code (:mod:`.poptorch`) on a ``poptorch`` module.

- ``ipu``: the Poplar SDK's PopTorch on IPU hardware; ``ipu_model``: on the IPU Model;
- ``emulator``: the PopTorch stand-in (:mod:`ipu_standins.poptorch`) on the CPU, passed to the
  same code as its poptorch module and never installed as ``poptorch`` in the process. The
  package's PopART custom ops run there with host numerics the package registers with the
  stand-in (:mod:`.standin_op_library`), as any op library's would.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..training.run_config import Config, TrainingConfig
from .backend_error import BackendError
from .registry import Capabilities, InferenceModel, Parameters, TrainingBackend

__all__ = ["PopTorchBackend", "IPU_BACKEND", "IPU_MODEL_BACKEND", "EMULATOR_BACKEND",
           "STANDIN_MODULE", "poptorch_module"]

STANDIN_MODULE = "ipu_standins.poptorch"


def _is_standin(poptorch: ModuleType) -> bool:
    # Under `ipu-unit-scaling emulate`, `import poptorch` gives the stand-in too.
    return poptorch.__name__.startswith("ipu_standins.")


class PopTorchBackend(TrainingBackend):
    """A backend of the IPU backend code: ``poptorch.trainingModel``, ``poptorch.optim``,
    ``poptorch.inferenceModel`` on the SDK's PopTorch (``standin=False``) or the stand-in."""

    def __init__(self, name: str, standin: bool, use_ipu_model: bool, on_device: bool):
        self.name = name
        self.standin = standin
        self.use_ipu_model = use_ipu_model
        self.capabilities = Capabilities(activations_on_device=on_device, traces_the_model=True)

    def check_available(self) -> None:
        if not self.standin:
            self.poptorch()

    def poptorch(self) -> ModuleType:
        """The ``poptorch`` module this backend runs the IPU backend code against."""
        if self.standin:
            from .standin_op_library import register_with_standin

            register_with_standin()
            return importlib.import_module(STANDIN_MODULE)
        try:
            return importlib.import_module("poptorch")
        except Exception as error:  # an SDK that is present but broken counts as absent
            raise BackendError(
                f"backend {self.name!r} needs PopTorch (Poplar SDK), which does not import "
                "here; use 'emulator', 'cpu' or 'auto', or unset IPU_UNIT_SCALING_BACKEND"
            ) from error

    def _needs_library(self, poptorch: ModuleType) -> bool:
        """Whether PopART needs ``custom_ops/``'s library: the stand-in runs the ops with the
        host numerics the package registered instead."""
        if _is_standin(poptorch):
            from .standin_op_library import register_with_standin

            register_with_standin()
            return False
        return True

    def make_optimizer(self, parameters: Parameters, training: TrainingConfig
                       ) -> torch.optim.Optimizer:
        from .poptorch.poptorch_training import make_ipu_optimizer

        return make_ipu_optimizer(parameters, training, self.poptorch())

    def build_training_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             config: Config) -> Any:
        from .poptorch.poptorch_training import IPUTrainingModel

        poptorch = self.poptorch()
        return IPUTrainingModel(model, optimizer, config.ipu,
                                fp8=config.precision.dtype == "fp8",
                                use_ipu_model=self.use_ipu_model, poptorch=poptorch,
                                needs_library=self._needs_library(poptorch))

    def build_inference_model(self, model: nn.Module, config: Config) -> InferenceModel:
        from .poptorch.poptorch_training import IPUInferenceModel

        poptorch = self.poptorch()
        return IPUInferenceModel(model, config.ipu, fp8=config.precision.dtype == "fp8",
                                 use_ipu_model=self.use_ipu_model, poptorch=poptorch,
                                 needs_library=self._needs_library(poptorch))


IPU_BACKEND = PopTorchBackend("ipu", standin=False, use_ipu_model=False, on_device=True)
IPU_MODEL_BACKEND = PopTorchBackend("ipu_model", standin=False, use_ipu_model=True,
                                    on_device=False)
# It computes what `ipu` computes on hardware (not the IPU Model), on the host.
EMULATOR_BACKEND = PopTorchBackend("emulator", standin=True, use_ipu_model=False,
                                   on_device=False)


def poptorch_module(backend: str) -> ModuleType:
    """The ``poptorch`` the IPU backend code runs against on ``backend`` (``ipu``,
    ``ipu_model`` or ``emulator``)."""
    from .registry import backend_named

    chosen = backend_named(backend)
    if not isinstance(chosen, PopTorchBackend):
        raise ValueError(f"backend {backend!r} does not run PopTorch")
    return chosen.poptorch()
