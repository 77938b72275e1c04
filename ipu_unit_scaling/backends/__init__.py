"""Backends: where a model trains, behind one small interface.

``build_training_model(model, optimizer, config)`` returns a wrapper called PopTorch-style,
``wrapper(inputs, labels) -> (output, loss)``, that runs backward and the optimizer step with
``poptorch.trainingModel``'s semantics (device iterations, gradient accumulation with mean
reduction, one loss per micro-batch). Each backend is one object (:mod:`.registry`), registered
by name, that carries its capabilities and builds its optimizer, training and inference models:

- ``ipu``: PopTorch on IPU hardware; ``ipu_model``: PopTorch on the IPU Model (no hardware);
- ``emulator``: the same IPU backend code (:mod:`.poptorch`: options, pipeline blocks,
  ``poptorch.trainingModel``, ``poptorch.optim``, the FP8 custom ops) run against the PopTorch
  stand-in (:mod:`ipu_standins.poptorch`) instead of the SDK's poptorch, on the CPU: the model
  is traced forward as PopTorch traces it, its gradients come from the traced graph as PopART's
  autodiff takes them, and the stand-in applies the options' batching, output mode and
  compile checks. It computes what ``ipu`` computes on hardware (not the IPU Model)
  (:mod:`.poptorch_backend`);
- ``cpu``: eager PyTorch (:mod:`.cpu`);
- ``popxl``: the unit-scaled GPT written in PopXL, with real FP8 matmuls (:mod:`.popxl_backend`);
- ``distributed``: processes started by torchrun, one per stage and replica of the config's
  IPU layout, on ``torch.distributed`` (:mod:`.distributed`): torchrun's data-parallel run
  (one IPU per replica) or its pipelined run, two objects under one name, the config's layout
  choosing between them (:mod:`.torchrun_backend`).

``auto`` picks ``distributed`` under torchrun with more than one process, else ``ipu`` when
PopTorch imports and IPU hardware is present, else ``ipu_model`` when PopTorch imports, else
``cpu``. ``IPU_UNIT_SCALING_BACKEND`` overrides the configured name. Only the IPU backend
(:mod:`.poptorch`) ever imports poptorch, and only on demand; the ``emulator`` backend passes it
the stand-in as its poptorch module, without installing it as ``poptorch`` in the process.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
from torch import nn

from ..training.run_config import Config, IPUConfig
from .backend_error import BackendError
from .distributed import check_launch, launched_world_size
from .pipeline_stages import Stage, ipu_stages
from .registry import Capabilities, InferenceModel, TrainingBackend, backend_named, registered_names

__all__ = [
    "BACKEND_ENV", "BackendError", "Stage", "ipu_stages", "select_backend", "make_optimizer",
    "build_training_model", "build_inference_model", "InferenceModel", "TrainingBackend",
    "Capabilities", "backend_named", "capabilities",
]

BACKEND_ENV = "IPU_UNIT_SCALING_BACKEND"


def _import_poptorch() -> Optional[Any]:
    try:
        return importlib.import_module("poptorch")
    except Exception:  # an SDK that is present but broken counts as absent
        return None


def _multi_process_backend() -> str:
    return next(name for name in registered_names()
                if backend_named(name).capabilities.spans_processes)


def capabilities(name: str, ipu: Optional[IPUConfig] = None) -> Capabilities:
    """What the backend ``name`` can do (see :class:`.registry.Capabilities`); given ``ipu``,
    what its object for that layout can do."""
    return backend_named(name, ipu).capabilities


def select_backend(name: str = "auto", config: Optional[Config] = None,
                   training: bool = True) -> str:
    """Resolve a backend name (or ``auto``) to the backend that runs here.

    Under torchrun with several processes that is ``distributed``, checked against
    ``config``'s layout when given. Not ``training`` (evaluation, sampling: one process),
    ``distributed`` is ``cpu``.
    """
    name = os.environ.get(BACKEND_ENV) or name
    chosen = backend_named(name) if name != "auto" else None
    spans = chosen is not None and chosen.capabilities.spans_processes
    world = launched_world_size()
    if not training:
        if spans or (chosen is None and world > 1):
            return "cpu"
    elif spans or (chosen is None and world > 1):
        check_launch(config.ipu if config is not None else None)
        return _multi_process_backend()
    elif world > 1:
        raise BackendError(f"torchrun started {world} processes, but backend {name!r} trains "
                           "on one; use 'auto' or 'distributed', or launch without torchrun")
    if chosen is not None:
        chosen.check_available()
        return name
    poptorch = _import_poptorch()
    if poptorch is None:
        return "cpu"
    return "ipu" if poptorch.ipuHardwareIsAvailable() else "ipu_model"


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
    return backend_named(backend, config.ipu).make_optimizer(params, training)


def build_training_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    backend: Optional[str] = None,
) -> Any:
    """Wrap ``model`` so that ``wrapper(inputs, labels) -> (output, loss)`` trains it.

    Each call runs ``config.ipu.device_iterations`` optimizer steps over inputs whose leading
    dimension is ``config.samples_per_call``; see :mod:`.cpu` for the exact semantics.
    The wrapper also has ``stages`` (the pipeline split), ``update_optimizer()`` (after
    changing learning rates), ``copy_weights_to_host()`` and ``destroy()``.
    """
    backend = backend or select_backend(config.backend)
    return backend_named(backend, config.ipu).build_training_model(model, optimizer, config)


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
    return backend_named(backend, config.ipu).build_inference_model(model, config)
