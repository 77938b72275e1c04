"""A stand-in for the part of PopART's Python module (``import popart``) that PopTorch programs
touch: its version, its logger, the enums whose integers go into
``poptorch.Options._Popart.set(...)`` and a :class:`SessionOptions` attribute bag.

PopTorch programs import popart for those names; they build and run their graphs through
PopTorch, so nothing here builds or runs a PopART session. A name the stand-in does not model
(``popart.Builder``, ``popart.TrainingSession``, ...) raises an AttributeError that says so. The
enum values and the option names are PopART's (SDK 3.4, ``willow/include/popart`` and its
Python bindings).
"""
from __future__ import annotations

import enum
import os
import sys
import threading
import time
from typing import Any, Dict, Tuple

__all__ = ["__version__", "versionString", "versionNumber", "getLogger", "Logger",
           "SessionOptions", "SyntheticDataMode", "RecomputationType", "VirtualGraphMode",
           "DeviceConnectionType", "AccumulateOuterFragmentSchedule", "SubgraphCopyingStrategy",
           "MergeVarUpdateType", "BatchSerializationBatchSchedule",
           "BatchSerializationTransformContext", "BatchSerializationMethod",
           "ExecutionPhaseIOSchedule", "ExecutionPhaseSchedule"]

__version__ = "3.3.0+standin"


def versionString() -> str:
    return __version__


def versionNumber() -> Tuple[int, int, int]:
    major, minor, point = __version__.partition("+")[0].split(".")
    return int(major), int(minor), int(point)


class SyntheticDataMode(enum.IntEnum):
    Off = 0
    Zeros = 1
    RandomNormal = 2
    RandomUniform = 3


class RecomputationType(enum.IntEnum):
    NoRecompute = 0  # PopART's RecomputationType::None, renamed in Python
    Standard = 1
    NormOnly = 2
    Pipeline = 3
    RecomputeAll = 4


class VirtualGraphMode(enum.IntEnum):
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class DeviceConnectionType(enum.IntEnum):
    Always = 0
    OnDemand = 1
    Never = 2


class AccumulateOuterFragmentSchedule(enum.IntEnum):
    """``accumulateOuterFragmentSettings.schedule``: how a pipeline's optimizer step is
    scheduled across IPUs (Optimum Graphcore sets OverlapMemoryOptimized)."""
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(enum.IntEnum):
    """``subgraphCopyingStrategy``: when a called subgraph's inputs and outputs are copied."""
    OnEnterAndExit = 0
    JustInTime = 1


class MergeVarUpdateType(enum.IntEnum):
    """``mergeVarUpdate``; PopART's Python name for ``MergeVarUpdateType::None`` is Off."""
    Off = 0
    All = 1
    AutoLoose = 2
    AutoTight = 3


class BatchSerializationBatchSchedule(enum.IntEnum):
    Scheduler = 0
    Isomorphic = 1
    OverlapOnIo = 2
    OverlapOnCompute = 3


class BatchSerializationTransformContext(enum.IntEnum):
    Fwd = 0
    Bwd = 1


class BatchSerializationMethod(enum.IntEnum):
    UnrollDynamic = 0
    UnrollStatic = 1
    Loop = 2


class ExecutionPhaseIOSchedule(enum.IntEnum):
    Preload = 0
    OnDemand = 1


class ExecutionPhaseSchedule(enum.IntEnum):
    Interleaving = 0
    Batch = 1
    BatchClusteredIO = 2


# ------------------------------------------------------------------------------ logging
# PopART's levels, lowest first; an unknown level name turns logging off, as in PopART.
_LEVELS = ("TRACE", "DEBUG", "INFO", "WARN", "ERR", "CRITICAL", "OFF")
_LETTERS = {"TRACE": "T", "DEBUG": "D", "INFO": "I", "WARN": "W", "ERR": "E", "CRITICAL": "C"}
_module_levels: Dict[str, str] = {}
_lock = threading.Lock()


def _level(name: str) -> str:
    return name if name in _LEVELS else "OFF"


def _default_level() -> str:
    return _level(os.environ.get("POPART_LOG_LEVEL", "WARN"))


class Logger:
    """``popart.getLogger(name)``: ``setLevel`` sets the level of PopART's logging module
    ``name`` ("all": every module); the messages of ``debug`` ... ``critical`` are the
    ``python`` module's and go to standard error when that module's level lets them."""

    def __init__(self, name: str = "all") -> None:
        self.name = name

    def setLevel(self, level: str) -> None:
        with _lock:
            if self.name == "all":
                _module_levels.clear()
                _module_levels["all"] = _level(level)
            else:
                _module_levels[self.name] = _level(level)

    def _log(self, level: str, message: str) -> None:
        current = _module_levels.get("python", _module_levels.get("all", _default_level()))
        if _LEVELS.index(level) < _LEVELS.index(current):
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        print(f"{stamp}Z popart:python {os.getpid()}.{threading.get_ident()} "
              f"{_LETTERS[level]}: {message}", file=sys.stderr)

    def debug(self, message: str) -> None:
        self._log("DEBUG", message)

    def info(self, message: str) -> None:
        self._log("INFO", message)

    def warn(self, message: str) -> None:
        self._log("WARN", message)

    def error(self, message: str) -> None:
        self._log("ERR", message)

    def critical(self, message: str) -> None:
        self._log("CRITICAL", message)


def getLogger(name: str = "all") -> Logger:
    return Logger(name)


# ------------------------------------------------------------------------------ options
# The fields of PopART's SessionOptions (its Python bindings' def_readwrite names).
_SESSION_OPTIONS = frozenset("""
logDir exportPoplarComputationGraph exportPoplarVertexGraph syntheticDataMode
instrumentWithHardwareCycleCounter hardwareInstrumentations disableGradAccumulationTensorStreams
disableOptimizerStateTensorStreams enableOutlining enableOutliningCopyCostPruning
outlineThreshold outlineSequenceBreakCost accumulationFactor enableGradientAccumulation
accumulationAndReplicationReductionType meanAccumulationAndReplicationReductionStrategy
enableNonStableSoftmax enablePipelining subgraphCopyingStrategy autoRecomputation
mergeVarUpdate mergeVarUpdateMemThreshold rearrangeAnchorsOnHost rearrangeStreamsOnHost
executionPhaseSettings explicitRecomputation experimentalSettings batchSerializationSettings
aliasZeroCopy enablePrefetchDatastreams defaultBufferingDepth bufferingDepthMap
virtualGraphMode virtualGraphSplitRatios enableReplicatedGraphs replicatedGraphCount
compileEngine _engineOptions _convolutionOptions _lstmOptions _matmulOptions _reportOptions
_gclOptions dotOpNames separateCallOpPdfs finalDotOp firstDotOp constantWeights cachePath
enableEngineCaching enableVariablesCaching enableFloatingPointChecks enableStochasticRounding
_enableRngStateManagement enableFullyConnectedPass partialsTypeMatMuls enableStableNorm
groupNormStridedChannelGrouping customCodelets updatableNamedBuffers customCodeletCompileFlags
kahnTieBreaker timeLimitScheduler swapLimitScheduler transitiveClosureOptimizationThreshold
decomposeGradSum serializedPoprithmsShiftGraphsDir serializedPoprithmsAnnealGraphsDir
enableDistributedReplicatedGraphs globalReplicationFactor globalReplicaOffset groupHostSync
strictOpVersions opxAliasChecking opxModifyChecking activationTensorLocationSettings
weightTensorLocationSettings optimizerStateTensorLocationSettings
accumulatorTensorLocationSettings _tensorLocationSettingsOverride
accumulateOuterFragmentSettings enableLoadAndOffloadRNGState automaticLossScalingSettings
replicatedCollectivesSettings useHostCopyOps enableEfficientOverlapIOTopoCons
enableSupportedDataTypeCasting enableExplicitMainLoops enableMergeExchange
ensureFp32LossScaleTensor delayVarUpdates scheduleNonWeightUpdateGradientConsumersEarly
dotChecks enableInplaceAmbiguityChecking createImplicitPipeliningFwdOnlyProgram
throwIfLog2ScaleTensorNotInRange enableConstantFoldingOfMultipleConsumers
useLoopCandidateCreator stashAllTensorsInferencePipeline
""".split())


class SessionOptions:
    """PopART's session options as a bag of the values a program sets. Only PopART's field
    names are taken; a field read before it was set raises (the stand-in does not model
    PopART's defaults: no PopART session runs here)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _SESSION_OPTIONS:
            raise AttributeError(f"'popart.SessionOptions' object has no attribute {name!r}")
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name in _SESSION_OPTIONS:
            raise AttributeError(
                f"popart.SessionOptions.{name} was not set, and the PopART stand-in does not "
                "model PopART's defaults")
        raise AttributeError(f"'popart.SessionOptions' object has no attribute {name!r}")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"module 'popart' has no attribute {name!r} in the PopART stand-in: it models only "
        f"what PopTorch programs take from popart ({', '.join(__all__)})")
