"""Backends: where a model trains, behind one small interface.

``build_training_model(model, optimizer, config)`` returns a wrapper called PopTorch-style,
``wrapper(inputs, labels) -> (output, loss)``, that runs backward and the optimizer step with
``poptorch.trainingModel``'s semantics (device iterations, gradient accumulation with mean
reduction, one loss per micro-batch). The backends:

- ``ipu``: PopTorch on IPU hardware; ``ipu_model``: PopTorch on the IPU Model (no hardware);
- ``emulator``: the same IPU backend code (:mod:`.poptorch`: options, pipeline blocks,
  ``poptorch.trainingModel``, ``poptorch.optim``, the FP8 custom ops) run against the PopTorch
  stand-in (:mod:`.poptorch_standin`) instead of the SDK's poptorch, on the CPU: the model is
  traced forward as PopTorch traces it, its gradients come from the traced graph as PopART's
  autodiff takes them, and the stand-in applies the options' batching, output mode and
  compile checks. It computes what ``ipu`` computes on hardware (not the IPU Model);
- ``cpu``: eager PyTorch;
- ``popxl``: the unit-scaled GPT written in PopXL, with real FP8 matmuls (:mod:`.popxl`);
- ``distributed``: processes started by torchrun, one per stage and replica of the config's
  IPU layout, on ``torch.distributed`` (:mod:`.distributed`).

``auto`` picks ``distributed`` under torchrun with more than one process, else ``ipu`` when
PopTorch imports and IPU hardware is present, else ``ipu_model`` when PopTorch imports, else
``cpu``. ``IPU_UNIT_SCALING_BACKEND`` overrides the configured name. Only the IPU backend
(:mod:`.poptorch`) ever imports poptorch, and only on demand; the ``emulator`` backend passes it
the stand-in as its poptorch module, without installing it as ``poptorch`` in the process.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Iterable, List, Optional, Protocol, Union

import torch
from torch import nn

from ..training.run_config import BACKEND_NAMES, Config
from .backend_error import BackendError
from .cpu import CPUTrainingModel, TrainingModule
from .distributed import check_launch, launched_world_size
from .pipeline_stages import Stage, stages

__all__ = [
    "BACKEND_ENV", "BackendError", "Stage", "stages", "select_backend",
    "make_optimizer", "build_training_model", "build_inference_model", "InferenceModel",
]

BACKEND_ENV = "IPU_UNIT_SCALING_BACKEND"
# The backends that run the IPU backend code (.poptorch): on the SDK's poptorch, or on the
# stand-in (emulator).
IPU_BACKENDS = ("ipu", "ipu_model", "emulator")


def _import_poptorch() -> Optional[Any]:
    try:
        return importlib.import_module("poptorch")
    except Exception:  # an SDK that is present but broken counts as absent
        return None


def select_backend(name: str = "auto", config: Optional[Config] = None,
                   training: bool = True) -> str:
    """Resolve a backend name (or ``auto``) to the backend that runs here.

    Under torchrun with several processes that is ``distributed``, checked against
    ``config``'s layout when given. Not ``training`` (evaluation, sampling: one process),
    ``distributed`` is ``cpu``.
    """
    name = os.environ.get(BACKEND_ENV) or name
    if name not in BACKEND_NAMES:
        raise BackendError(f"backend {name!r} unknown; allowed: {', '.join(BACKEND_NAMES)}")
    world = launched_world_size()
    if not training:
        if name == "distributed" or (name == "auto" and world > 1):
            return "cpu"
    elif name == "distributed" or (name == "auto" and world > 1):
        check_launch(config)
        return "distributed"
    elif world > 1:
        raise BackendError(f"torchrun started {world} processes, but backend {name!r} trains "
                           "on one; use 'auto' or 'distributed', or launch without torchrun")
    if name in ("cpu", "emulator"):
        return name
    if name == "popxl":
        from .popxl import popxl_available

        if not popxl_available():
            raise BackendError(
                "backend 'popxl' needs PopXL (the Poplar SDK's popxl), which does not import "
                f"here; use 'emulator', 'cpu' or 'auto', or unset {BACKEND_ENV}")
        return name
    poptorch = _import_poptorch()
    if name == "auto":
        if poptorch is None:
            return "cpu"
        return "ipu" if poptorch.ipuHardwareIsAvailable() else "ipu_model"
    if poptorch is None:
        raise BackendError(
            f"backend {name!r} needs PopTorch (Poplar SDK), which does not import here; "
            f"use 'emulator', 'cpu' or 'auto', or unset {BACKEND_ENV}"
        )
    return name


def make_optimizer(
    parameters: Union[nn.Module, Iterable[nn.Parameter]],
    config: Config,
    backend: Optional[str] = None,
    model: Optional[nn.Module] = None,
) -> torch.optim.Optimizer:
    """The optimizer ``config.training`` names, in the flavour the backend needs.

    ``parameters`` is the model, or the parameters to optimize. Under u-μP
    (``model.parametrization: u-mup``) each tensor's learning rate depends on its type, which
    the model tells (:func:`ipu_unit_scaling.parametrization.umup.weight_rules`): pass the model,
    or the
    parameters and ``model=``; the groups are :func:`ipu_unit_scaling.optim.param_groups`.
    """
    backend = backend or select_backend(config.backend)
    if isinstance(parameters, nn.Module):
        model = parameters if model is None else model
        parameters = parameters.parameters()
    params: Union[Iterable[nn.Parameter], List[Dict[str, Any]]] = parameters
    training = config.training
    lr, decay = training.learning_rate, training.weight_decay
    if config.model.parametrization == "u-mup":
        from ..parametrization.mup_optimizers import param_groups

        if model is None:
            raise TypeError("u-μP needs the model to type its parameters: pass the model, or "
                            "model=")
        # Adam's decay is an L2 term Adam normalises; the decoupled decays are made
        # independent of the learning rate (see ipu_unit_scaling.optim).
        # A given model (training.given_model) types its parameters as uu modules do.
        umup_rules = getattr(model, "umup_rules", None)
        rules = umup_rules() if callable(umup_rules) else None
        params = param_groups(model, lr, decay, training.optimizer != "adam", parameters, rules)
    if backend in IPU_BACKENDS:
        from .poptorch import poptorch_module
        from .poptorch.poptorch_training import make_ipu_optimizer

        return make_ipu_optimizer(params, config, poptorch_module(backend))
    if training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=decay)
    if training.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=decay)


def build_training_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    backend: Optional[str] = None,
) -> Union[CPUTrainingModel, Any]:
    """Wrap ``model`` so that ``wrapper(inputs, labels) -> (output, loss)`` trains it.

    Each call runs ``config.ipu.device_iterations`` optimizer steps over inputs whose leading
    dimension is ``config.samples_per_call``; see :mod:`.cpu` for the exact semantics.
    The wrapper also has ``stages`` (the pipeline split), ``update_optimizer()`` (after
    changing learning rates), ``copy_weights_to_host()`` and ``destroy()``.
    """
    backend = backend or select_backend(config.backend)
    if backend == "cpu":
        split = stages(model, config)
        ipu = config.ipu
        return CPUTrainingModel(
            TrainingModule(model),
            optimizer,
            device_iterations=ipu.device_iterations,
            gradient_accumulation=ipu.gradient_accumulation,
            replication_factor=ipu.replication_factor,
            max_grad_norm=config.training.grad_clip,
            split=split,
        )
    if backend in IPU_BACKENDS:
        from .poptorch import poptorch_module
        from .poptorch.poptorch_training import IPUTrainingModel

        return IPUTrainingModel(model, optimizer, config, use_ipu_model=backend == "ipu_model",
                                poptorch=poptorch_module(backend))
    if backend == "popxl":
        from .popxl import PopXLTrainingModel

        return PopXLTrainingModel(model, optimizer, config)
    if backend == "distributed":
        from .distributed import DistributedTrainingModel

        return DistributedTrainingModel(model, optimizer, config)
    raise BackendError(f"backend {backend!r} cannot build a training model")


class InferenceModel(Protocol):
    """What :func:`build_inference_model` returns."""

    rows_per_call: int  # a call's rows must be a multiple of it

    def __call__(self, *inputs: Any) -> Any:
        ...

    def destroy(self) -> None:
        ...


def build_inference_model(model: nn.Module, config: Config,
                          backend: Optional[str] = None) -> InferenceModel:
    """Wrap ``model`` for evaluation and sampling: ``wrapper(*inputs)`` is ``model(*inputs)``
    in eval mode without gradients, on the backend.

    ``ipu``/``ipu_model`` build a ``poptorch.inferenceModel`` traced under ``ipu_tracing()``
    (the same rules as training), and ``emulator`` the same on the PopTorch stand-in; ``cpu``
    (and ``popxl``, whose programs are for training, and ``distributed``, whose ranks evaluate
    alike) run eager PyTorch, the code path of training's evaluation.
    """
    backend = backend or select_backend(config.backend)
    if backend in IPU_BACKENDS:
        from .poptorch import poptorch_module
        from .poptorch.poptorch_training import IPUInferenceModel

        return IPUInferenceModel(model, config, use_ipu_model=backend == "ipu_model",
                                 poptorch=poptorch_module(backend))
    if backend in ("cpu", "popxl", "distributed"):
        return _EvalWrapper(model, model)
    raise BackendError(f"backend {backend!r} cannot build an inference model")


class _EvalWrapper:
    rows_per_call = 1

    def __init__(self, runner: nn.Module, model: nn.Module):
        self.runner = runner
        self.model = model

    def __call__(self, *inputs: Any) -> Any:
        self.model.eval()
        with torch.no_grad():
            return self.runner(*inputs)

    def destroy(self) -> None:
        """Nothing to release off the IPU."""
