"""``poptorch.options``: :class:`Options` and its sub-objects, with PopTorch's setters, defaults
and argument checks (graphcore/poptorch ``python/options.py``).

Settings that only tune an IPU (memory, tiles, patterns, caching, profiling, sync patterns) are
accepted, checked as PopTorch checks them and recorded; the stand-in reads the ones that change
what is computed: device iterations, replication, gradient accumulation and its reduction, the
output mode, the execution strategy and its blocks, partials type, stochastic rounding, the
IPU Model and the random seed.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List, Optional

import torch

from . import enums
from ._options_dict import FROZEN_MESSAGE, OptionsDict

__all__ = [
    "Attribute", "ConfigFileError", "Options", "TensorLocationSettings", "Stage", "Phase",
    "PipelinedExecution", "ShardedExecution", "ParallelPhasedExecution", "SerialPhasedExecution",
]


class Attribute:
    """Context manager giving attributes to the ops created inside it (recorded only)."""

    _current: Dict[str, Any] = {}

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._saved: Dict[str, Any] = {}

    def __enter__(self) -> Attribute:
        self._saved = copy.deepcopy(Attribute._current)
        Attribute._current.update(self._kwargs)
        return self

    def __exit__(self, *exc: Any) -> None:
        Attribute._current = self._saved


class ConfigFileError(Exception):
    """A line of an options file that does not parse."""


class _JitOptions(OptionsDict):
    def traceModel(self, trace_model: bool) -> _JitOptions:
        if trace_model:
            raise ValueError("options.Jit.traceModel(True) is no longer supported")
        return self


class _PopartOptions:
    """Options passed on to PopART (``opts._Popart.set(key, value)``): recorded; an unknown key
    or a value of a type PopART cannot take is refused by ``poptorch_core._validateOptions``
    (at compile time), as PopTorch refuses it."""

    def __init__(self) -> None:
        self._is_frozen = False
        self.options: Dict[str, Any] = {}
        self.set("instrumentWithHardwareCycleCounter", False)
        self.set("rearrangeAnchorsOnHost", False)

    def __deepcopy__(self, memo: Dict[int, Any]) -> _PopartOptions:
        result = _PopartOptions()
        memo[id(self)] = result
        result.options = copy.deepcopy(self.options, memo)
        return result

    def checkIsFrozen(self, option: Any = None) -> None:
        if getattr(self, "_is_frozen", False) and option != "_is_frozen":
            raise AttributeError(FROZEN_MESSAGE)

    def set(self, key: str, value: Any) -> _PopartOptions:
        self.checkIsFrozen()
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options: Dict[str, str]) -> _PopartOptions:
        return self.set("engineOptions", engine_options)

    def setPatterns(self, patterns: Dict[str, bool], level: int = 2) -> _PopartOptions:
        assert isinstance(level, int)
        assert isinstance(patterns, dict)
        self.set("patterns_level", level)
        return self.set("patterns", patterns)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({body})"


class _PrecisionOptions(OptionsDict):
    def __init__(self, popart_options: _PopartOptions) -> None:
        self._popart_options = popart_options
        super().__init__()

    def halfFloatCasting(self, half_float_casting: Any) -> _PrecisionOptions:
        return self  # deprecated in PopTorch: HalfUpcastToFloat is the only behaviour

    def runningStatisticsAlwaysFloat(self, value: bool) -> _PrecisionOptions:
        if not isinstance(value, bool):
            raise ValueError("runningStatisticsAlwaysFloat needs to be set to a bool")
        return self

    def enableFloatingPointExceptions(self, enabled: bool) -> _PrecisionOptions:
        assert isinstance(enabled, bool), (
            "enableFloatingPointExceptions needs to be set to a bool")
        self._popart_options.set("enableFloatingPointChecks", enabled)
        return self

    def enableStochasticRounding(self, enabled: bool) -> _PrecisionOptions:
        """Float-to-half casts round stochastically (the lowering's stochastic rounding)."""
        self._popart_options.set("enableStochasticRounding", enabled)
        return self

    def setPartialsType(self, dtype: torch.dtype) -> _PrecisionOptions:
        """Matmul partials in ``torch.half``: the stand-in rounds each matmul's float32
        accumulation to float16 (what half partials lose), or keeps float (the default)."""
        if dtype in (torch.float, torch.float32):
            kind = "float"
        elif dtype in (torch.half, torch.float16):
            kind = "half"
        else:
            raise ValueError("parameter to setPartialsType should be either"
                             "torch.float or torch.half")
        self._popart_options.set("partialsTypeMatMuls", kind)
        self._popart_options.set("convolutionOptions", {"partialsType": kind})
        return self


class _TrainingOptions(OptionsDict):
    def __init__(self, popart_options: _PopartOptions) -> None:
        self._popart_options = popart_options
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=enums.ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=enums.MeanReductionStrategy.Post)

    def gradientAccumulation(self, gradient_accumulation: int) -> _TrainingOptions:
        self.set(gradient_accumulation=gradient_accumulation)
        return self

    def accumulationAndReplicationReductionType(
            self, reduction_type: enums.ReductionType) -> _TrainingOptions:
        if not isinstance(reduction_type, enums.ReductionType) or (
                reduction_type == enums.ReductionType.NoReduction):
            raise ValueError("accumulationAndReplicationReductionType must be set to "
                             "poptorch.ReductionType.Mean or poptorch.ReductionType.Sum")
        self.set(accumulation_and_replication_reduction_type=reduction_type)
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, strategy: enums.MeanReductionStrategy) -> _TrainingOptions:
        self.set(meanAccumulationAndReplicationReductionStrategy=strategy)
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> _TrainingOptions:
        self._popart_options.set("automaticLossScalingSettings.enabled", enabled)
        return self

    def setConvolutionDithering(self, enabled: bool) -> _TrainingOptions:
        self._popart_options.set("convolutionOptions", {"enableConvDithering": enabled})
        return self


class _DistributedOptions(OptionsDict):
    def __init__(self) -> None:
        self._gcd_mappings: Dict[Any, Any] = {}
        super().__init__(num_distributed_processes=1, distributed_process_id=0,
                         ipuof_configs={})
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    def disable(self) -> _DistributedOptions:
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str
                       ) -> _DistributedOptions:
        return self.configureProcessId(int(os.environ.get(var_process_id, "0")),
                                       int(os.environ.get(var_num_processes, "1")))

    def configureProcessId(self, process_id: int, num_processes: int) -> _DistributedOptions:
        self.set(distributed_process_id=process_id)
        self.set(num_distributed_processes=num_processes)
        return self

    @property
    def processId(self) -> int:
        return self.distributed_process_id

    @property
    def numProcesses(self) -> int:
        return self.num_distributed_processes


class TensorLocationSettings(OptionsDict):
    """Where a class of tensors lives (recorded only: the host has one memory)."""

    def _flag(self, name: str, use: Any) -> TensorLocationSettings:
        assert isinstance(use, bool)
        self.createOrSet(**{name: int(use)})
        return self

    def minElementsForOffChip(self, min_elements: int) -> TensorLocationSettings:
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForOffChip=min_elements)
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements: int
                                               ) -> TensorLocationSettings:
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForReplicatedTensorSharding=min_elements)
        return self

    def useOnChipStorage(self, use: Optional[bool] = True) -> TensorLocationSettings:
        if use is None:
            self.deleteIfExists("onChip")
            return self
        return self._flag("onChip", use)

    def useReplicatedTensorSharding(self, use: bool = True) -> TensorLocationSettings:
        return self._flag("useReplicatedTensorSharding", use)

    def useIOTilesToLoad(self, use: bool = True) -> TensorLocationSettings:
        return self._flag("useIOTilesToLoad", use)

    def useIOTilesToStore(self, use: bool = True) -> TensorLocationSettings:
        return self._flag("useIOTilesToStore", use)


class _TensorLocationOptions(OptionsDict):
    def numIOTiles(self, num_tiles: int) -> _TensorLocationOptions:
        assert isinstance(num_tiles, int)
        message = "numIOTiles must be an even number between 32 and 192."
        assert 32 <= num_tiles <= 192 and num_tiles % 2 == 0, message
        self.createOrSet(numIOTiles=num_tiles)
        return self

    def _location(self, name: str, location: TensorLocationSettings
                  ) -> _TensorLocationOptions:
        assert isinstance(location, TensorLocationSettings)
        self.createOrSet(**{name: location.toDict()})
        return self

    def setActivationLocation(self, location: TensorLocationSettings) -> Any:
        return self._location("location_activation", location)

    def setWeightLocation(self, location: TensorLocationSettings) -> Any:
        return self._location("location_weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings) -> Any:
        return self._location("location_optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings) -> Any:
        return self._location("location_accumulator", location)


# Stages, phases and execution strategies live in their own module; re-exported here as
# PopTorch's ``poptorch.options`` exports them.
from ._strategies import (  # noqa: E402
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    _IExecutionStrategy,
)


def _string_to_enum(value: str) -> Any:
    kind, _, name = value.partition(".")
    enum_type = getattr(enums, kind, None)
    return getattr(enum_type, name, value) if enum_type is not None else value


class Options(OptionsDict):
    """All the options of a PopTorch model (``poptorch.Options``)."""

    def __init__(self) -> None:
        self._jit = _JitOptions()
        self._popart = _PopartOptions()
        self._graphProcessing = _PrecisionOptions(self._popart)
        self._training = _TrainingOptions(self._popart)
        self._distributed = _DistributedOptions()
        self._tensor_locations = _TensorLocationOptions()
        self._execution_strategy: Any = PipelinedExecution()
        self._source_location_excludes = ["install/poptorch", "site-packages/torch",
                                          "site-packages/poptorch"]
        self._show_compilation_progress_bar = True
        self._relax_optimizer_checks = False
        self._module_namescope_enabled = True
        super().__init__(
            replication_factor=1, input_group_size=1,
            input_cgt=enums.CommGroupType.Consecutive, broadcast_buffers=True,
            device_iterations=1, log_dir=".", max_repeat_logs=4, auto_round_num_ipus=False,
            anchored_tensors={}, output_mode=enums.OutputMode.Default.value,
            output_return_period=1, connection_type=enums.ConnectionType.Always.value,
            sync_pattern=enums.SyncPattern.Full.value, available_memory_proportion={})
        path = os.environ.get("POPTORCH_CACHE_DIR", "")
        if path:
            self.enableExecutableCaching(path)
        self.from_json(os.environ.get("POPTORCH_DEFAULT_OPTIONS", "{}"))

    def from_json(self, string: str) -> Options:
        for option, value in json.loads(string).items():
            target: Any = self
            for attribute in option.split("."):
                target = getattr(target, attribute)
            if isinstance(value, str) and "." in value:
                value = _string_to_enum(value)
            if isinstance(value, list):
                target(*value)
            else:
                target(value)
        return self

    def sourceLocationExcludes(self, excludes: List[str]) -> Options:
        self._source_location_excludes = excludes
        return self

    def appendToLocationExcludes(self, *excludes: str) -> Options:
        self._source_location_excludes += excludes
        return self

    def showCompilationProgressBar(self, show: bool = True) -> Options:
        self._show_compilation_progress_bar = show
        return self

    def loadFromFile(self, filepath: str) -> Options:
        """Run each line of ``filepath`` as ``options.<line>`` (blank lines and ``#`` comments
        skipped); a line that does not parse raises :class:`ConfigFileError`."""
        from .. import poptorch  # the package, for the file's names

        with open(filepath) as handle:
            lines = ["options." + line.strip() for line in handle
                     if line.strip() and not line.strip().startswith("#")]
        try:
            exec("\n".join(lines), {}, {"poptorch": poptorch, "options": self})  # noqa: S102
        except SyntaxError as error:
            raise ConfigFileError(
                f"{type(error).__name__} at line {error.lineno} of "
                f"{os.path.basename(filepath)}: {error.args[0]}\n> {error.text}") from None
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Options:
        self._relax_optimizer_checks = relax
        return self

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        return self._tensor_locations

    @property
    def Distributed(self) -> _DistributedOptions:
        return self._distributed

    @property
    def Jit(self) -> _JitOptions:
        return self._jit

    @property
    def Precision(self) -> _PrecisionOptions:
        return self._graphProcessing

    @property
    def Training(self) -> _TrainingOptions:
        return self._training

    @property
    def _Popart(self) -> _PopartOptions:
        return self._popart

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Options:
        self.set(auto_round_num_ipus=auto_round_num_ipus)
        return self

    def deviceIterations(self, device_iterations: int) -> Options:
        self.set(device_iterations=device_iterations)
        return self

    def setExecutionStrategy(self, strategy: Any) -> Options:
        assert isinstance(strategy, _IExecutionStrategy)
        self._execution_strategy = strategy
        return self

    def setAvailableMemoryProportion(self, available_memory_proportion: Dict[str, float]
                                     ) -> Options:
        proportions = {}
        for key, value in available_memory_proportion.items():
            assert key.startswith("IPU"), (
                "Available memory proportions are expected to be in a dictionary of "
                "{\"IPU0\": 0.5} where the 0 in IPU is the index of the IPU. "
                f"Invalid key: {key}")
            proportions[int(key[3:])] = value
        self.createOrSet(available_memory_proportion=proportions)
        return self

    def replicationFactor(self, replication_factor: int) -> Options:
        self.set(replication_factor=replication_factor)
        return self

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: enums.CommGroupType) -> Options:
        if input_group_type == enums.CommGroupType.NoGrouping:
            input_group_size, input_group_type = 1, enums.CommGroupType.Consecutive
        if input_group_type == enums.CommGroupType.All:
            raise ValueError("input_group_type cannot be All")
        if self.replication_factor < input_group_size:
            raise ValueError("input_group_size cannot be larger than replication_factor")
        if self.replication_factor % input_group_size:
            raise ValueError("input_group_size must be a factor of replication_factor")
        self.set(input_group_size=input_group_size)
        self.set(input_cgt=input_group_type)
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> Options:
        self.set(broadcast_buffers=broadcast_buffers)
        return self

    def logDir(self, log_dir: str) -> Options:
        self.set(log_dir=log_dir)
        return self

    def maxRepeatLogs(self, max_lines: Optional[int]) -> Options:
        self.set(max_repeat_logs=(1 << 64) - 1 if max_lines is None else max_lines)
        return self

    def modelName(self, name: str) -> Options:
        self.createOrSet(model_name=name)
        return self

    def enableExecutableCaching(self, path: Optional[str]) -> Options:
        if path is None:
            self._Popart.set("enableEngineCaching", False)
        else:
            self._Popart.set("cachePath", path)
            self._Popart.set("enableEngineCaching", True)
        return self

    def useIpuModel(self, use_model: bool) -> Options:
        """Run on the IPU Model: the stand-in then computes the IPU Model's numerics where they
        differ from hardware (GELU's gradient: see :mod:`._numerics`)."""
        self.createOrSet(use_model=use_model)
        return self

    def connectionType(self, connection_type: enums.ConnectionType) -> Options:
        assert isinstance(connection_type, enums.ConnectionType)
        self.set(connection_type=connection_type.value)
        return self

    def syncPattern(self, sync_pattern: enums.SyncPattern) -> Options:
        assert isinstance(sync_pattern, enums.SyncPattern)
        self.set(sync_pattern=sync_pattern.value)
        return self

    def useIpuId(self, ipu_id: int) -> Options:
        assert isinstance(ipu_id, int)
        self.createOrSet(ipu_id=ipu_id)
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Options:
        self.connectionType(enums.ConnectionType.Never)
        self.createOrSet(ipu_version=ipu_version)
        return self

    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: Optional[enums.OutputMode] = None,
                     output_return_period: Optional[int] = 1) -> None:
        if output_mode != enums.OutputMode.EveryN:
            output_return_period = 1
        self.anchored_tensors[short_name] = [long_name, output_mode is None, output_mode,
                                             output_return_period]

    def outputMode(self, output_mode: enums.OutputMode,
                   output_return_period: Optional[int] = None) -> Options:
        assert isinstance(output_mode, enums.OutputMode)
        if output_mode == enums.OutputMode.EveryN:
            assert output_return_period and output_return_period > 0, (
                "EveryN anchor must have output_return_period set to valid positive integer")
        self.set(output_mode=output_mode.value,
                 output_return_period=output_return_period or 1)
        return self

    def defaultOutputMode(self) -> bool:
        return self.output_mode == enums.OutputMode.Default

    def randomSeed(self, random_seed: int) -> Options:
        assert isinstance(random_seed, int)
        torch.manual_seed(random_seed)
        self.createOrSet(random_seed=random_seed)
        return self

    def enableStableNorm(self, enabled: bool) -> Options:
        self._Popart.set("enableStableNorm", enabled)
        return self

    def enableSyntheticData(self, enabled: bool) -> Options:
        self._Popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    def logCycleCount(self, log_cycle_count: bool) -> Options:
        self._Popart.set("instrumentWithHardwareCycleCounter", log_cycle_count)
        return self

    def enableProfiling(self, profile_dir: Optional[str] = None) -> Options:
        engine = self._popart.options.get("engineOptions", {})
        engine.update({"debug.allowOutOfMemory": "true",
                       "autoReport.directory": profile_dir or ".", "autoReport.all": "true"})
        self._popart.setEngineOptions(engine)
        return self

    def disableModuleNamescope(self) -> Options:
        self._module_namescope_enabled = False
        return self

    def updatableNamedBuffers(self, buffers: List[str]) -> Options:
        self._Popart.set("updatableNamedBuffers", buffers)
        return self

    def toDict(self) -> Dict[str, Any]:
        assert not self.defaultOutputMode(), "An output mode must be picked before serialisation"
        out = self._execution_strategy.backendOptions()
        out.update(self._popart.options)
        out = self.update(out)
        for part in (self._training, self._distributed, self._tensor_locations):
            out = part.update(out)
        return out

    def clone(self) -> Options:
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        properties = [p for p in dir(type(self)) if isinstance(getattr(type(self), p), property)]
        return (f"{type(self).__name__}("
                + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ", "
                + ", ".join(f"{p}={getattr(self, p)}" for p in properties) + ")")
