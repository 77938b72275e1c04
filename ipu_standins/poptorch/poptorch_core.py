"""``poptorch.poptorch_core``: PopTorch's error classes and the few entry points of its C++
module that programs and tests call directly."""
from __future__ import annotations

import enum
import os
from typing import Any, Dict

import torch

from .. import emulated_system

__all__ = ["Error", "RecoverableError", "UnrecoverableError", "TestErrorType",
           "isCompilingWithDispatcher", "ipuHardwareVersion", "_validateOptions",
           "_throwTestError", "importPoptorchMetadataFromFile"]


class Error(RuntimeError):
    """What PopTorch raises (``poptorch.Error``); ``message``, ``type`` and ``location`` as
    PopTorch sets them."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.message = str(args[0]) if args else ""
        self.type = "poptorch_cpp_error"
        self.location = ""
        self.recovery_action = ""


class RecoverableError(Error):
    """An error after which the application can go on (an IPU reset, say)."""


class UnrecoverableError(Error):
    """An error after which the IPU cannot be used any more."""


class TestErrorType(enum.IntEnum):
    Poptorch = 0
    Popart = 1
    PopartInternal = 2
    Poplibs = 3
    PoplarUnrecoverable = 4
    PoplarUnknown = 5
    PoplarRecoverableFullReset = 6
    PoplarLinkError = 7


_TEST_ERRORS = {
    TestErrorType.Poptorch: (Error, "poptorch_cpp_error", "test error"),
    TestErrorType.Popart: (Error, "popart_exception", "test error"),
    TestErrorType.PopartInternal: (Error, "popart_internal_exception", "test error"),
    TestErrorType.Poplibs: (Error, "poplibs_exception", "test error"),
    TestErrorType.PoplarUnrecoverable: (UnrecoverableError,
                                        "poplar_unrecoverable_runtime_error", "test error"),
    TestErrorType.PoplarUnknown: (Error, "poplar_unknown_runtime_error", "test error"),
    TestErrorType.PoplarRecoverableFullReset: (RecoverableError,
                                               "poplar_recoverable_runtime_error",
                                               "test error"),
    TestErrorType.PoplarLinkError: (Error, "poplar_link_error",
                                    "test error: link error: -lfoo not found"),
}


def _throwTestError(error: TestErrorType) -> None:
    """Raise the error PopTorch's C++ raises for ``error`` (PopTorch's own tests call it):
    its type, message and the location (a two-frame backtrace)."""
    kind, name, message = _TEST_ERRORS[TestErrorType(error)]
    location = "throwTestError::topLevel\nthrowTestError::bottomLevel"
    failure = kind(f"In {location}: {name}: {message}")
    failure.type, failure.message, failure.location = name, message, location
    if kind is RecoverableError:
        failure.recovery_action = "FULL_RESET"
    raise failure


def isCompilingWithDispatcher() -> bool:
    """True while a model is being traced."""
    from . import _state

    return _state.ON_IPU


def _ipu_model_environment() -> bool:
    """Whether ``POPTORCH_IPU_MODEL`` or ``POPTORCH_SMALL_IPU_MODEL`` asks for the IPU Model
    (a non-zero integer), which hides the hardware from PopTorch."""
    for name in ("POPTORCH_IPU_MODEL", "POPTORCH_SMALL_IPU_MODEL"):
        text = os.environ.get(name)
        if text is not None:
            try:
                if int(text) != 0:
                    return True
            except ValueError:
                raise Error(f"{name}={text!r}: expected an integer") from None
    return False


def ipuHardwareVersion(numIpus: int = 1) -> int:
    """The IPU version of a device of ``numIpus`` IPUs: 2 (Mk2) where the emulated IPU system
    (:mod:`ipu_standins.emulated_system`, set up by ``ipu-unit-scaling emulate``) has one,
    otherwise 0, as PopTorch reports without one; 0 also where ``POPTORCH_IPU_MODEL`` or
    ``POPTORCH_SMALL_IPU_MODEL`` is set non-zero, as in PopTorch."""
    if _ipu_model_environment() or not emulated_system.device_available(int(numIpus)):
        return 0
    return emulated_system.IPU_VERSION


def importPoptorchMetadataFromFile(filename: str) -> Any:
    raise Error(f"{filename}: no PopTorch executable can be loaded without the Poplar SDK")


# Option names the backend knows: PopTorch's own (Options.toDict()) and the PopART session
# options that PopTorch programs set through opts._Popart.set().
_KNOWN = frozenset("""
replication_factor input_group_size input_cgt broadcast_buffers device_iterations log_dir
max_repeat_logs auto_round_num_ipus anchored_tensors output_mode output_return_period
connection_type sync_pattern available_memory_proportion random_seed use_model ipu_id
ipu_version model_name gradient_accumulation accumulation_and_replication_reduction_type
meanAccumulationAndReplicationReductionStrategy num_distributed_processes
distributed_process_id ipuof_configs execution_mode separate_backward_phase tensors_liveness
serial_phases_execution numIOTiles location_activation location_weight location_optimizer
location_accumulator compilation_progress_bar_fn
instrumentWithHardwareCycleCounter rearrangeAnchorsOnHost enableFloatingPointChecks
enableStochasticRounding partialsTypeMatMuls convolutionOptions matmulOptions lstmOptions
gclOptions engineOptions reportOptions patterns patterns_level cachePath enableEngineCaching
enableStableNorm syntheticDataMode updatableNamedBuffers saveInitializersToFile
autoRecomputation enableOutlining outlineThreshold outlineSequenceBreakCost
enablePrefetchDatastreams defaultPrefetchBufferingDepth groupNormStridedChannelGrouping
decomposeGradSum enableGradientAccumulation accumulationFactor enablePipelining
virtualGraphMode subgraphCopyingStrategy scheduleNonWeightUpdateGradientConsumersEarly
enableReplicatedGraphs replicatedGraphCount constantWeights timeLimitScheduler
swapLimitScheduler transitiveClosureOptimizationThreshold enableMergeExchange
exportPoplarComputationGraph exportPoplarVertexGraph separateCallOpPdfs dotChecks
finalDotOp firstDotOp globalReplicationFactor globalReplicaOffset
enableLoadAndOffloadRNGState opxAliasChecking opxModifyChecking
enableDistributedReplicatedGraphs useHostCopyOps enableExplicitMainLoops aliasZeroCopy
delayVarUpdates explicitRecomputation enableSerializedMatmuls strictOpVersions
disableGradAccumulationTensorStreams enableNonStableSoftmax logDir customCodelets
hardwareInstrumentations enableExplicitIR kahnTieBreaker mergeVarUpdate
mergeVarUpdateMemThreshold looseThresholdAtPeak enableFullyConnectedPass
enableDistributedReplicatedGraphs enableGroupedMatmuls groupedMatmuls
enableInplaceAmbiguityChecking enableFloatingPointChecks useLoopCandidateCreator
compileEngine enableEfficientOverlapIOTopoCons createImplicitPipeliningFwdOnlyProgram
throwIfLog2ScaleTensorNotInRange enableConstantFoldingOfMultipleConsumers
autoRecomputationEnabled partialsTypeConvolutions swapLimitCompaction
accumulatorTensorLocationSettings.location.storage
""".split())
_KNOWN_PREFIXES = ("accumulateOuterFragmentSettings.", "automaticLossScalingSettings.",
                   "executionPhaseSettings.", "batchSerializationSettings.",
                   "replicatedCollectivesSettings.", "autodiffSettings.",
                   "experimentalSettings.", "tensorLocationSettingsOverride.",
                   "developerSettings.", "numIOTiles", "location_")
_VALUE_TYPES = (bool, int, float, str, list, tuple, set, dict, type(None), enum.Enum)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, enum.Enum)):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "map"
    return "container"


def _validateOptions(options: Dict[str, Any]) -> None:
    """Refuse what the backend refuses when it reads the options: a value of a type it cannot
    take, or a name it does not know."""
    for name, value in options.items():
        if callable(value) and not isinstance(value, (enum.Enum, type)):
            continue  # the compilation progress bar's callback
        if isinstance(value, torch.Tensor) or not isinstance(value, _VALUE_TYPES):
            raise Error(f"Unknown value type {type(value).__name__} for option {name}")
        if name not in _KNOWN and not name.startswith(_KNOWN_PREFIXES):
            raise Error(f"Unknown {_type_name(value)} option {name}")
