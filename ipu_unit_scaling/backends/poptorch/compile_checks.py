"""What PopTorch refuses before an IPU runs anything: its compile-time checks of the options.

The checks read the ``poptorch.Options`` calls the IPU backend makes (:mod:`.poptorch_options`), so
the emulator refuses exactly the configs that PopTorch would refuse, and the IPU backend refuses
them before it asks for an IPU. Each check names the PopTorch source it follows (graphcore/
poptorch at commit c2a8b17762f1, September 2023):

- ``python/_poplar_executor.py`` (``PoplarExecutor.__init__``): an inference model takes no
  gradient accumulation;
- ``popart_compiler/source/Compiler.cpp`` (``Compiler::initSession``) with
  ``CompilerImpl::numPipelineStages``: under ``PipelinedExecution`` a training model needs
  ``gradientAccumulation >= 2 x forward stages - 1`` and an inference model needs
  ``deviceIterations >= forward stages``; ``ShardedExecution`` has neither rule;
- ``popart_compiler/source/CompilerImpl.cpp`` (``createDevice``): IPUs used x replicas is at
  most 64, and on hardware a power of two unless ``autoRoundNumIPUs`` is set;
- ``python/_poplar_executor.py`` (``_narrow_tensor``, ``_compileWithDispatch``): every input's
  leading dimension is a multiple of ``deviceIterations x replicationFactor x
  gradientAccumulation``, and no input requires grad.

A forward stage is a run of blocks on one IPU: PopTorch counts one more each time the IPU
changes while it traces, so stages that hold no module do not count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ...training.run_config import IPUConfig
from ..backend_error import BackendError
from ..pipeline_stages import Stage
from .poptorch_options import New, OptionCall, option_calls

__all__ = [
    "PopTorchError", "CompileOptions", "forward_stages", "check_compile", "check_inputs",
    "check_config_compiles", "MAX_IPUS",
]

MAX_IPUS = 64  # per process, without distributed execution


class PopTorchError(BackendError):
    """What PopTorch would refuse: a config at compile time, or an op while tracing."""


@dataclass(frozen=True)
class CompileOptions:
    """The values of a ``poptorch.Options`` that its compile-time checks read."""

    device_iterations: int = 1
    replication_factor: int = 1
    gradient_accumulation: int = 1
    strategy: Optional[str] = None  # "PipelinedExecution", "ShardedExecution" or None (default)
    auto_round_num_ipus: bool = False
    ipu_model: bool = False

    @classmethod
    def from_calls(cls, calls: Sequence[OptionCall]) -> CompileOptions:
        """The values ``calls`` set on a fresh ``poptorch.Options``."""
        values: dict = {}
        for call in calls:
            if call.method == "deviceIterations":
                values["device_iterations"] = int(call.args[0])
            elif call.method == "replicationFactor":
                values["replication_factor"] = int(call.args[0])
            elif call.method == "Training.gradientAccumulation":
                values["gradient_accumulation"] = int(call.args[0])
            elif call.method == "setExecutionStrategy":
                strategy = call.args[0]
                values["strategy"] = strategy.path if isinstance(strategy, New) else str(strategy)
            elif call.method == "autoRoundNumIPUs":
                values["auto_round_num_ipus"] = bool(call.args[0])
            elif call.method == "useIpuModel":
                values["ipu_model"] = bool(call.args[0])
        return cls(**values)

    @property
    def pipelined(self) -> bool:
        # poptorch.Options starts with PipelinedExecution(); ShardedExecution derives from it
        # but runs one stage at a time, without the pipeline's rules.
        return self.strategy in (None, "PipelinedExecution")

    @property
    def rows_per_call(self) -> int:
        """The multiple every input's leading dimension must be."""
        return self.device_iterations * self.replication_factor * self.gradient_accumulation


def forward_stages(stage_modules: Sequence[Sequence[str]]) -> int:
    """Forward pipeline stages of a split given as the module names of each IPU, in order."""
    return max(1, sum(1 for modules in stage_modules if modules))


def _refuse(what: str, why: str, source: str) -> PopTorchError:
    return PopTorchError(f"{what}: {why}; PopTorch refuses it at compile time ({source})")


def check_compile(options: CompileOptions, *, training: bool, stages: int, ipus: int) -> None:
    """Raise :class:`PopTorchError` for the first compile-time check ``options`` fail.

    ``stages``: forward pipeline stages (:func:`forward_stages`); ``ipus``: IPUs one replica
    uses (the highest IPU id + 1).
    """
    kind = "training" if training else "inference"
    if not training and options.gradient_accumulation != 1:
        raise _refuse(
            f"gradient accumulation {options.gradient_accumulation} in an inference model",
            "poptorch.inferenceModel takes Training.gradientAccumulation = 1 only",
            "python/_poplar_executor.py")
    if options.pipelined and stages > 1:
        if training and options.gradient_accumulation < 2 * stages - 1:
            raise _refuse(
                f"ipu.gradient_accumulation = {options.gradient_accumulation} for a "
                f"{stages}-stage pipelined training model",
                f"PipelinedExecution needs Training.gradientAccumulation >= the 2 x {stages} - 1 "
                f"= {2 * stages - 1} pipeline stages of training (forward and backward)",
                "popart_compiler/source/Compiler.cpp")
        if not training and options.device_iterations < stages:
            raise _refuse(
                f"ipu.device_iterations = {options.device_iterations} for a {stages}-stage "
                f"pipelined {kind} model",
                f"PipelinedExecution needs deviceIterations >= the {stages} pipeline stages",
                "popart_compiler/source/Compiler.cpp")
    total = ipus * options.replication_factor
    if total > MAX_IPUS:
        raise _refuse(
            f"{ipus} IPUs x {options.replication_factor} replicas = {total} IPUs",
            f"one process can use at most {MAX_IPUS} IPUs",
            "popart_compiler/source/CompilerImpl.cpp")
    if not options.ipu_model and total & (total - 1) and not options.auto_round_num_ipus:
        raise _refuse(
            f"{ipus} IPUs x {options.replication_factor} replicas = {total} IPUs",
            "IPU hardware is reserved in powers of two; set ipu.auto_round_num_ipus: true "
            "(autoRoundNumIPUs) or change the replication factor",
            "popart_compiler/source/CompilerImpl.cpp")


def check_inputs(options: CompileOptions, inputs: Sequence[Any]) -> None:
    """Raise :class:`PopTorchError` if PopTorch would refuse ``inputs`` for one call."""
    per_call = options.rows_per_call
    for index, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            continue
        rows = value.shape[0] if value.dim() else 1
        if rows % per_call:
            raise PopTorchError(
                f"input {index} has {rows} rows, not a multiple of deviceIterations x "
                f"replicationFactor x gradientAccumulation = {options.device_iterations} x "
                f"{options.replication_factor} x {options.gradient_accumulation} = {per_call}; "
                "PopTorch refuses it (python/_poplar_executor.py)")
        if value.requires_grad:
            raise PopTorchError(
                f"input {index} requires grad; PopTorch refuses such inputs "
                "(python/_poplar_executor.py)")


def check_config_compiles(ipu: IPUConfig, split: Sequence[Stage], *, training: bool,
                          use_ipu_model: bool = False) -> CompileOptions:
    """Apply :func:`check_compile` to the options the IPU backend builds from ``ipu`` for a
    training (or inference) model placed by ``split``; returns those options."""
    options = CompileOptions.from_calls(
        option_calls(ipu, use_ipu_model, inference=not training))
    used = [stage.index for stage in split if stage.modules]
    check_compile(options, training=training,
                  stages=forward_stages([stage.modules for stage in split]),
                  ipus=max(used) + 1 if used else 1)
    return options
