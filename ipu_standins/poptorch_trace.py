"""The PopTorch stand-in's trace, for checking a model before spending IPU time.

PopTorch has no such function: it traces inside ``trainingModel``. This gives the same trace
(:func:`trace_like_poptorch`: fake tensors, PopTorch's refusals and handler list, the lowering
of what PopART computes differently) without compiling or running a model.
"""
from __future__ import annotations

from .poptorch._tracer import PopTorchReport, PopTorchTrace, trace_like_poptorch

__all__ = ["PopTorchReport", "PopTorchTrace", "trace_like_poptorch"]
