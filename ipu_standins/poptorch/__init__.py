"""A stand-in for PopTorch (``import poptorch``) that runs PopTorch programs on a CPU.

It follows PopTorch's public Python API and its semantics, read from graphcore/poptorch's
source (``python/``): :class:`Options` and their checks, ``trainingModel``/``inferenceModel``
with PopTorch's batching, reductions and output modes, blocks and pipeline stage counting,
the one-final-loss rule, ``DataLoader``, ``poptorch.optim`` and the ops of ``poptorch.ops``.
Models are traced as PopTorch traces them (see :mod:`._compile`): what PopTorch refuses while
tracing is refused here too. Nothing runs on an IPU; under ``ipu-unit-scaling emulate`` the
stand-in reports an emulated IPU system (:mod:`ipu_standins.emulated_system`), otherwise none.

``import poptorch`` resolves to this package only when asked
(:func:`ipu_standins.install.install`, or the command
``ipu-unit-scaling emulate``), and never where the Poplar SDK's PopTorch imports.
"""
from __future__ import annotations

import abc
import builtins
import copy
from typing import Any, Optional, Type

import torch

from . import (
    _args,
    _impl,
    _logging,
    _poplar_executor,
    enums,
    ops,
    optim,  # noqa: E402  (after the modules it may import)
    options,
    poptorch_core,
    testing,
)
from ._dataloader import AsynchronousDataAccessor, DataLoader
from ._executor import PoplarExecutor
from ._impl import (
    createPoptorchError,
    isRunningOnIpu,
    registerPostCompileHook,
    registerPreCompileHook,
)
from ._logging import setLogLevel
from ._saving import load
from .enums import (
    AutoStage,
    CommGroupType,
    ConnectionType,
    DataLoaderMode,
    HalfFloatCastingBehavior,
    Liveness,
    MatMulSerializationMode,
    MeanReductionStrategy,
    MultiConvPlanType,
    OutputMode,
    OverlapMode,
    ReductionType,
    SharingStrategy,
    SyncPattern,
    VariableRetrievalMode,
)
from .ops import (
    CPU,
    BeginBlock,
    Block,
    BlockFunction,
    MultiConv,
    NameScope,
    cond,
    ctc_beam_search_decoder,
    custom_op,
    dynamic_slice,
    dynamic_update,
    for_loop,
    identity_loss,
    ipu_print_tensor,
    nop,
    recomputationCheckpoint,
    removeBlocks,
    serializedMatMul,
    set_available_memory,
    set_overlap_for_input,
    set_overlap_for_output,
)
from .options import (
    Attribute,
    Options,
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    TensorLocationSettings,
)
from .poptorch_core import Error, RecoverableError, UnrecoverableError

__version__ = "3.3.0+standin"

__all__ = [
    "Options", "trainingModel", "inferenceModel", "PoplarExecutor", "DataLoader",
    "AsynchronousDataAccessor", "identity_loss", "BeginBlock", "Block", "BlockFunction",
    "Stage", "Phase", "AutoStage", "PipelinedExecution", "ShardedExecution",
    "SerialPhasedExecution", "ParallelPhasedExecution", "removeBlocks", "custom_op",
    "isRunningOnIpu", "ipuHardwareIsAvailable", "ipuHardwareVersion", "setLogLevel",
    "Error", "RecoverableError", "UnrecoverableError", "CPU", "load", "module_repr", "optim",
    "OutputMode", "ReductionType", "MeanReductionStrategy", "DataLoaderMode", "SyncPattern",
    "ConnectionType", "Liveness", "OverlapMode", "MatMulSerializationMode", "CommGroupType",
    "VariableRetrievalMode", "MultiConv", "MultiConvPlanType", "serializedMatMul",
    "NameScope", "set_overlap_for_input", "set_overlap_for_output", "set_available_memory",
    "ipu_print_tensor", "recomputationCheckpoint", "nop", "for_loop", "cond",
    "dynamic_slice", "dynamic_update", "ctc_beam_search_decoder", "TensorLocationSettings",
    "Attribute", "HalfFloatCastingBehavior", "SharingStrategy", "ICustomArgParser",
    "registerCustomArgParser", "createPoptorchError", "enums", "options", "ops",
    "poptorch_core", "testing", "registerPreCompileHook", "registerPostCompileHook",
]


def trainingModel(model: Any, options: Optional[Options] = None,
                  optimizer: Optional[torch.optim.Optimizer] = None) -> PoplarExecutor:
    """Wrap ``model`` for training: each call runs forward, backward and the optimizer step
    (``poptorch.optim.SGD(lr=0.01)`` if no optimizer is given)."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    if _impl.isWrapped(model):
        raise RuntimeError("Model has already been wrapped in 'poptorch.trainingModel'. Call "
                           "model.destroy() on the model to unwrap before wrapping again.")
    return PoplarExecutor(model=copy.copy(model), options=options, training=True,
                          optimizer=optimizer, user_model=model)


def inferenceModel(model: Any, options: Optional[Options] = None) -> PoplarExecutor:
    """Wrap ``model`` for inference (no gradients; outputs of every micro-batch by default)."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    return PoplarExecutor(model=copy.copy(model), options=options, training=False,
                          user_model=model)


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """Whether the system has a device of ``num_ipus`` IPUs: under ``ipu-unit-scaling
    emulate``, the emulated IPU-POD's (:mod:`ipu_standins.emulated_system`); otherwise none."""
    return poptorch_core.ipuHardwareVersion(num_ipus) != 0


def ipuHardwareVersion() -> int:
    """The system's IPU version (2 under ``emulate``); fails as PopTorch does without one."""
    version = poptorch_core.ipuHardwareVersion()
    assert version != 0, "No IPU hardware available on this system"
    return version


def module_repr(m: torch.nn.Module) -> str:
    """``repr(m)`` with the blocks ``BeginBlock`` gave its modules."""
    extra = m.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    children = []
    for key, module in m._modules.items():
        text = module_repr(module) if module is not None else "None"
        children.append(f"({key}): " + "\n  ".join(text.split("\n")))
    lines = extra_lines + children
    text = "".join(repr(h) + " " for h in m._forward_pre_hooks.values()) + m._get_name() + "("
    if lines:
        if len(extra_lines) == 1 and not children:
            text += extra_lines[0]
        else:
            text += "\n  " + "\n  ".join(lines) + "\n"
    return text + ")"


def print(m: Any) -> None:  # noqa: A001  (PopTorch's name)
    if isinstance(m, torch.nn.Module):
        builtins.print(module_repr(m))
    builtins.print(m)


class ICustomArgParser(abc.ABC):
    """How to find the tensors of a custom input type, and rebuild it from them."""

    @abc.abstractmethod
    def yieldTensors(self, struct: Any) -> Any:
        """Yield the tensors of ``struct``."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: Any, tensor_iterator: Any) -> Any:
        """``original_structure`` with its tensors taken from ``tensor_iterator``."""


def registerCustomArgParser(arg_data_type: Type[Any],
                            arg_parser: Optional[ICustomArgParser]) -> None:
    if arg_parser is None:
        _args.CUSTOM_PARSERS.pop(arg_data_type, None)
        return
    if not isinstance(arg_parser, ICustomArgParser):
        raise createPoptorchError("arg_parser must inherit from ICustomArgParser")
    _args.CUSTOM_PARSERS[arg_data_type] = arg_parser


__all__ += ["_logging", "_poplar_executor"]
