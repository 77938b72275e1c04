"""The PopXL backend: the unit-scaled FP8 GPT in PopXL, with real FP8 tensors and FP8 matmuls.

Nothing here imports ``popxl`` until it is asked to run on it, so the package imports anywhere.
The model code (:mod:`.popxl_model`, :mod:`.fp8_ops`) is written once against the ``popxl`` module;
the PopXL stand-in (:mod:`ipu_standins.popxl`) is a torch stand-in for the part of PopXL it uses,
on which it is tested here.

- :class:`PopXLTrainingModel`: ``poptorch.trainingModel``'s interface on PopXL.
- :func:`loss_and_gradients`: one forward and backward pass of a ``uu.GPT``.
- :func:`popxl_available`: whether ``popxl`` imports.

FP8 AMAX scales come from PopXL ops by default, or (``amax="codelets"``) from the codelets as a
PopXL custom op (:mod:`.codelets`, built from ``custom_ops/popxl_fp8_amax_cast.cpp``).
"""
from __future__ import annotations

from .fp8_ops import (
    AMAX_SOURCES,
    CastSite,
    FP8LinearBlock,
    popxl_cast_to_fp8,
    popxl_fp8_matmul,
    scaling_bias,
)
from .popxl_model import DecoderSpec, PopXLDecoder, Tape, scaled
from .popxl_training import (
    OptimizerSpec,
    PopXLTrainingModel,
    StepResult,
    TrainingProgram,
    check_config,
    check_sections,
    default_device,
    import_popxl,
    loss_and_gradients,
    popxl_available,
)

__all__ = [
    "PopXLTrainingModel", "loss_and_gradients", "StepResult", "popxl_available",
    "import_popxl", "default_device", "check_config", "check_sections", "OptimizerSpec",
    "TrainingProgram",
    "DecoderSpec", "PopXLDecoder", "Tape", "scaled", "scaling_bias", "popxl_cast_to_fp8",
    "popxl_fp8_matmul", "FP8LinearBlock", "CastSite", "AMAX_SOURCES",
]
