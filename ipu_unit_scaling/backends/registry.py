"""Backends as objects: one registered object per backend, asked instead of compared by name.

A :class:`TrainingBackend` carries its name, its :class:`Capabilities` and its factories: the
optimizer the backend steps, the training model (``wrapper(inputs, labels) -> (output, loss)`` with
``poptorch.trainingModel``'s semantics) and the inference model. :data:`BUILTIN` registers the
package's backends, each named by where its object lives and imported only when asked for;
:func:`register` adds another, so adding a backend is its module and one line there.

A name may stand for several objects, one for each layout of the config's ``ipu`` section:
``distributed`` is torchrun's data-parallel run or its pipelined run
(:mod:`.torchrun_backend`). Asked with the layout, :func:`backend_named` gives the object that
runs it (:meth:`TrainingBackend.for_layout`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Protocol, Tuple, Union

import torch
from torch import nn

from ..training.config_files import short_repr
from ..training.run_config import Config, IPUConfig, TrainingConfig
from .backend_error import BackendError

__all__ = ["Capabilities", "TrainingBackend", "InferenceModel", "EagerInference", "BUILTIN",
           "register", "unregister", "backend_named", "registered_names", "torch_optimizer"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, for the code that chooses what to run on it."""

    # Activations live in IPU memory, not the host's (the memory check leaves them out).
    activations_on_device: bool = False
    # It trains a model a config names by its factory (model.factory), not only the GPT.
    trains_given_model: bool = True
    # It trains the masked LM's encoder, not only the GPT.
    trains_masked_lm: bool = True
    # Its training runs as several processes under torchrun.
    spans_processes: bool = False
    # It traces the model into a graph (PopTorch, PopXL): no Python hook of the model runs
    # while it trains, so run telemetry replays a sampled step on the host.
    traces_the_model: bool = False


class InferenceModel(Protocol):
    """What :meth:`TrainingBackend.build_inference_model` returns."""

    rows_per_call: int  # a call's rows must be a multiple of it

    def __call__(self, *inputs: Any) -> Any:
        ...

    def destroy(self) -> None:
        ...


Parameters = Union[Iterable[nn.Parameter], List[Dict[str, Any]]]


def torch_optimizer(parameters: Parameters, training: TrainingConfig) -> torch.optim.Optimizer:
    """The torch optimizer ``training.optimizer`` names (parameters, or u-μP's groups)."""
    lr, decay = training.learning_rate, training.weight_decay
    if training.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=lr, weight_decay=decay)
    if training.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=lr, weight_decay=decay)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=decay)


class EagerInference:
    """Evaluation and sampling in eager PyTorch on the host: ``model(*inputs)`` in eval mode,
    without gradients."""

    rows_per_call = 1

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *inputs: Any) -> Any:
        self.model.eval()
        with torch.no_grad():
            return self.model(*inputs)

    def destroy(self) -> None:
        """Nothing to release off the IPU."""


class TrainingBackend:
    """One backend. Subclasses set :attr:`name` and :attr:`capabilities` and build the
    training model; the defaults step a torch optimizer and evaluate eagerly on the host."""

    name: str = ""
    capabilities: Capabilities = Capabilities()

    def check_available(self) -> None:
        """Raise :class:`BackendError` saying why this backend cannot run here."""

    def for_layout(self, ipu: IPUConfig) -> TrainingBackend:
        """The object that runs ``ipu``'s layout under this name: this one, unless the name
        stands for several runs."""
        return self

    def make_optimizer(self, parameters: Parameters, training: TrainingConfig
                       ) -> torch.optim.Optimizer:
        """The optimizer ``training`` names, in the flavour this backend steps."""
        return torch_optimizer(parameters, training)

    def build_training_model(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             config: Config) -> Any:
        """``wrapper(inputs, labels) -> (output, loss)``, with ``stages``,
        ``update_optimizer()``, ``copy_weights_to_host()`` and ``destroy()``."""
        raise BackendError(f"backend {self.name!r} cannot build a training model")

    def build_inference_model(self, model: nn.Module, config: Config) -> InferenceModel:
        """``wrapper(*inputs)``: ``model(*inputs)`` in eval mode without gradients."""
        return EagerInference(model)


# The package's backends: name -> "module:attribute" of its object under ipu_unit_scaling.backends.
BUILTIN: Dict[str, str] = {
    "ipu": "poptorch_backend:IPU_BACKEND",
    "ipu_model": "poptorch_backend:IPU_MODEL_BACKEND",
    "emulator": "poptorch_backend:EMULATOR_BACKEND",
    "cpu": "cpu:CPU_BACKEND",
    "popxl": "popxl_backend:POPXL_BACKEND",
    "distributed": "torchrun_backend:TORCHRUN_BACKEND",
}

_registered: Dict[str, Union[TrainingBackend, str]] = dict(BUILTIN)


def register(backend: TrainingBackend) -> TrainingBackend:
    """Make ``backend`` selectable by its name (replacing one of the same name)."""
    if not backend.name:
        raise ValueError("a backend needs a name")
    _registered[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Forget the backend ``name`` (a built-in one comes back as it was)."""
    _registered.pop(name, None)
    if name in BUILTIN:
        _registered[name] = BUILTIN[name]


def registered_names() -> Tuple[str, ...]:
    return tuple(_registered)


def backend_named(name: str, ipu: Optional[IPUConfig] = None) -> TrainingBackend:
    """The backend registered as ``name``, or given ``ipu``, the one of its objects that runs
    that layout; BackendError naming the others if there is none."""
    entry = _registered.get(name)
    if entry is None:
        raise BackendError(f"backend {short_repr(name)} unknown; allowed: auto, "
                           f"{', '.join(registered_names())}")
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        assert isinstance(entry, TrainingBackend) and entry.name == name, entry
        _registered[name] = entry
    return entry if ipu is None else entry.for_layout(ipu)
