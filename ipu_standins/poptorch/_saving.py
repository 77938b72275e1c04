"""``PoplarExecutor.save``/``compileAndExport`` and ``poptorch.load``: the stand-in's
"executable" is the model, options, optimizer and compiled inputs, saved with ``torch.save``."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from ._executor import NO_EXECUTABLE_ERR
from ._impl import createPoptorchError, unwrapIfWrapped

__all__ = ["save_executor", "load"]

_MAGIC = "poptorch-standin-executable"


def save_executor(executor: Any, filename: str, export_model: bool = True) -> None:
    if not executor.isCompiled():
        raise createPoptorchError(NO_EXECUTABLE_ERR)
    folder = os.path.dirname(filename)
    if folder:
        os.makedirs(folder, exist_ok=True)
    if os.path.isdir(filename):
        filename = os.path.join(filename, "model.poptorch")
    data = {"magic": _MAGIC, "model": None, "training": None, "optimizer": None,
            "options": executor.options.clone(), "inputs": executor._executable_inputs}
    if not export_model:
        torch.save(data, filename)
        return
    executor.copyWeightsToHostIfNeeded()
    wrapper = type(executor._user_model)
    data.update(model=unwrapIfWrapped(executor._user_model), training=executor.training,
                optimizer=executor._optimizer)
    try:
        # One pickle, as PopTorch's: the loaded optimizer updates the loaded model's parameters.
        torch.save(data, filename)
    finally:
        executor._user_model.__class__ = wrapper


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
