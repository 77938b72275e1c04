"""Running on IPUs: the PopTorch switch and the check to run before spending IPU time.

- :func:`ipu_tracing`: inside it every op of the package takes its PopTorch form (see
  :mod:`ipu_unit_scaling.ops.trace_switch`). The IPU backends enter it around PopTorch's trace, and
  the emulator does the same.
- :func:`check_poptorch`: traces a model the way PopTorch does, with no SDK, and reports
  what PopTorch would refuse (host reads, moves to the CPU, float8 tensors, arguments its
  handlers refuse) and the ops it has no handler for, each with the op and the module.
- :func:`trace_like_poptorch`: the same trace, callable: its gradients are those PopART's
  autodiff would compute.
"""
from __future__ import annotations

from .backends.poptorch.compile_checks import PopTorchError
from .backends.poptorch_emulator import (
    PopTorchReport,
    PopTorchTrace,
    check_poptorch,
    trace_like_poptorch,
)
from .ops.trace_switch import ipu_tracing, is_ipu_tracing

__all__ = [
    "ipu_tracing", "is_ipu_tracing", "check_poptorch", "trace_like_poptorch", "PopTorchError",
    "PopTorchReport", "PopTorchTrace",
]
