"""``PoplarExecutor.save``/``compileAndExport`` and ``poptorch.load``: the stand-in's
"executable" is the model, options, optimizer and compiled inputs, saved with ``torch.save``."""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Optional

import torch

from ._impl import unwrapIfWrapped

__all__ = ["save_executor", "load"]

_MAGIC = "poptorch-standin-executable"


def save_executor(executor: Any, filename: str, export_model: bool = True) -> None:
    if os.path.isdir(filename):
        filename = os.path.join(filename, "model.poptorch")
    model = None
    if export_model:
        executor.copyWeightsToHostIfNeeded() if executor.isCompiled() else None
        wrapper = type(executor._user_model)
        model = unwrapIfWrapped(executor._user_model)
        try:
            model = copy.deepcopy(model)
        finally:
            executor._user_model.__class__ = wrapper
    data = {"magic": _MAGIC, "model": model, "training": executor.training,
            "options": executor.options.clone(), "optimizer": executor._optimizer,
            "inputs": executor._executable_inputs}
    torch.save(data, filename)


def read(filename: str) -> Any:
    try:
        data = torch.load(filename, weights_only=False)
    except TypeError:  # torch 2.0: no weights_only argument
        data = torch.load(filename)
    assert isinstance(data, dict) and data.get("magic") == _MAGIC, (
        f"Invalid file {filename}: not a PopTorch executable")
    return data


def load(filename: str, edit_opts_fn: Optional[Callable[[Any], None]] = None) -> Any:
    """A PopTorch model saved by ``compileAndExport``/``save``, compiled for the saved inputs."""
    from . import inferenceModel, trainingModel

    data = read(filename)
    assert data["model"] is not None and data["training"] is not None, (
        f"{filename} is a valid PopTorch file but was created with 'export_model=False' which "
        "means you need to re-create the PopTorch model using poptorch.inferenceModel or "
        "poptorch.trainingModel then call "
        f"poptorch_model.loadExecutable(\"{filename}\").")
    options = data["options"]
    options._unfreeze()
    if edit_opts_fn:
        edit_opts_fn(options)
    if data["training"]:
        executor = trainingModel(data["model"], options, data["optimizer"])
    else:
        executor = inferenceModel(data["model"], options)
    if data["inputs"] is not None:
        executor._compile(data["inputs"])
    return executor
