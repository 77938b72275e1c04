"""Config -> ``poptorch.Options``, as data.

``option_calls(config.ipu)`` is a pure function returning the method calls to make on a fresh
``poptorch.Options()``, e.g. ``OptionCall("Training.gradientAccumulation", (16,))``. Arguments
that are PopTorch or torch objects are written as ``Ref("ReductionType.Mean")`` (an attribute
path in poptorch) or ``Ref("half", module="torch")``, and ``New("PipelinedExecution", ...)``
for an object to construct. ``apply_option_calls`` resolves them against the real module and
follows each method path with getattr, so the mapping can be read and tested without PopTorch.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ...training.run_config import IPUConfig


@dataclass(frozen=True)
class Ref:
    """An attribute of poptorch (or of ``module``) by dotted path."""

    path: str
    module: str = "poptorch"


@dataclass(frozen=True)
class New:
    """``poptorch.<path>(*args)``, built when the calls are applied."""

    path: str
    args: Tuple[Any, ...] = ()


@dataclass(frozen=True)
class OptionCall:
    method: str  # dotted path on the Options object, e.g. "Training.gradientAccumulation"
    args: Tuple[Any, ...] = ()


def option_calls(ipu: IPUConfig, use_ipu_model: bool = False,
                 inference: bool = False) -> List[OptionCall]:
    """The ``poptorch.Options`` calls that realise the config's ``ipu`` section for training,
    or with ``inference`` for a ``poptorch.inferenceModel``.

    Inference sets no ``Training`` options (PopTorch takes gradient accumulation 1 only) and
    runs a multi-IPU split as ``ShardedExecution``: one micro-batch passes the IPUs in turn.
    ``PipelinedExecution`` would need at least as many device iterations as IPUs, that is as
    many windows per call, while sampling draws one token at a time from one window.
    """
    calls = [
        OptionCall("deviceIterations", (ipu.device_iterations,)),
        OptionCall("replicationFactor", (ipu.replication_factor,)),
    ]
    if not inference:
        calls += [
            OptionCall("Training.gradientAccumulation", (ipu.gradient_accumulation,)),
            # Mean over micro-batches and replicas keeps the learning rate independent of both.
            OptionCall(
                "Training.accumulationAndReplicationReductionType", (Ref("ReductionType.Mean"),)
            ),
        ]
    # One result per micro-batch comes back, like the CPU fallback returns.
    calls.append(OptionCall("outputMode", (Ref("OutputMode.All"),)))
    memory = _memory_proportions(ipu)
    if memory is not None:
        calls.append(OptionCall("setAvailableMemoryProportion", (memory,)))
    partials = "half" if ipu.partials_type == "half" else "float"
    calls.append(OptionCall("Precision.setPartialsType", (Ref(partials, module="torch"),)))
    calls.append(OptionCall("Precision.enableStochasticRounding", (ipu.stochastic_rounding,)))
    if ipu.executable_cache_dir:
        calls.append(OptionCall("enableExecutableCaching", (ipu.executable_cache_dir,)))
    if ipu.ipus_per_replica > 1:
        execution = "ShardedExecution" if inference else "PipelinedExecution"
        strategy = New(execution, (Ref("AutoStage.AutoIncrement"),))
        calls.append(OptionCall("setExecutionStrategy", (strategy,)))
    if ipu.auto_round_num_ipus:
        calls.append(OptionCall("autoRoundNumIPUs", (True,)))
    if use_ipu_model:
        calls.append(OptionCall("useIpuModel", (True,)))
    return calls


def _memory_proportions(ipu: IPUConfig) -> Optional[dict]:
    proportion = ipu.available_memory_proportion
    if proportion is None:
        return None
    ipus = ipu.ipus_per_replica
    values = proportion if isinstance(proportion, list) else [proportion] * ipus
    return {f"IPU{i}": float(v) for i, v in enumerate(values)}


def resolve(value: Any, modules: dict) -> Any:
    """Turn Ref/New markers into real objects; plain values pass through."""
    if isinstance(value, Ref):
        return functools.reduce(getattr, value.path.split("."), modules[value.module])
    if isinstance(value, New):
        target = functools.reduce(getattr, value.path.split("."), modules["poptorch"])
        return target(*(resolve(a, modules) for a in value.args))
    if isinstance(value, dict):
        return {k: resolve(v, modules) for k, v in value.items()}
    return value


def apply_option_calls(options: Any, calls: List[OptionCall], poptorch: Any) -> Any:
    """Make ``calls`` on ``options`` (a ``poptorch.Options`` or a stand-in) and return it."""
    import torch

    modules = {"poptorch": poptorch, "torch": torch}
    for call in calls:
        method = functools.reduce(getattr, call.method.split("."), options)
        method(*(resolve(a, modules) for a in call.args))
    return options


def build_options(ipu: IPUConfig, use_ipu_model: bool = False, inference: bool = False,
                  poptorch: Any = None) -> Any:
    """``poptorch.Options`` for ``config``, of the ``poptorch`` module given (the SDK's or the
    stand-in, :func:`ipu_unit_scaling.backends.poptorch_backend.poptorch_module`); by default
    ``import poptorch``."""
    if poptorch is None:
        poptorch = importlib.import_module("poptorch")
    calls = option_calls(ipu, use_ipu_model, inference)
    return apply_option_calls(poptorch.Options(), calls, poptorch)
