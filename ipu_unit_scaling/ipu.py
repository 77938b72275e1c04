"""Running on IPUs: the PopTorch switch and the check to run before spending IPU time.

- :func:`ipu_tracing`: inside it every op of the package takes its PopTorch form (see
  :mod:`ipu_unit_scaling.ops.trace_switch`). The IPU backends enter it around PopTorch's trace.
- :func:`check_poptorch`: traces a model the way PopTorch does, with no SDK, and reports
  what PopTorch would refuse (host reads, moves to the CPU, float8 tensors, arguments its
  handlers refuse) and the ops it has no handler for, each with the op and the module.
- :func:`trace_like_poptorch`: the same trace, callable: its gradients are those PopART's
  autodiff would compute.

Both trace with the PopTorch stand-in's tracer (:mod:`ipu_standins.poptorch_trace`), the model in
its PopTorch form as the IPU backend runs it: inside :func:`ipu_tracing`, with the backend's
rewrites; the package's FP8 custom ops are each one op of the graph, as on an IPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from ipu_standins.poptorch import Error as StandInError
from ipu_standins.poptorch_trace import PopTorchReport, PopTorchTrace
from ipu_standins.poptorch_trace import trace_like_poptorch as _standin_trace

from .backends.poptorch.compile_checks import PopTorchError
from .backends.standin_op_library import register_with_standin as register_standin_op_library
from .ops.trace_switch import ipu_tracing, is_ipu_tracing

__all__ = [
    "ipu_tracing", "is_ipu_tracing", "check_poptorch", "trace_like_poptorch", "PopTorchError",
    "PopTorchReport", "PopTorchTrace",
]


@contextlib.contextmanager
def _poptorch_form() -> Iterator[None]:
    """The model's PopTorch form, as the IPU backend traces it: every op of the package in its
    traced form, and the calls PopTorch would refuse rewritten to exact equivalents."""
    from .backends.poptorch.rewrites import PopTorchRewrites

    with ipu_tracing(), PopTorchRewrites():
        yield


def trace_like_poptorch(module: nn.Module, *inputs: Any, stochastic_rounding: bool = False,
                        allow_constants: bool = False) -> PopTorchTrace:
    """Trace ``module(*inputs)`` the way PopTorch does, the module in its PopTorch form.

    Raises :class:`PopTorchError` for what PopTorch refuses while tracing (host reads of a
    tensor, moves to the CPU, float8 tensors, arguments a handler refuses), naming the op and
    the module; unsupported ops are collected in ``trace.report``. The module's train/eval
    mode is traced as it is. The trace computes what an IPU computes where PopART departs from
    eager torch (GELU; with ``stochastic_rounding``, as ``Precision.enableStochasticRounding``,
    the float-half casts). With ``allow_constants``, tensors the model holds outside its
    parameters and buffers become constants of the graph, as PopTorch uploads them.
    """
    register_standin_op_library()  # the FP8 custom ops: one op each, as on an IPU
    try:
        return _standin_trace(module, *inputs, stochastic_rounding=stochastic_rounding,
                              allow_constants=allow_constants, context=_poptorch_form)
    except StandInError as error:
        raise PopTorchError(str(error)) from None


def check_poptorch(model: nn.Module, *inputs: Any, strict: bool = True) -> PopTorchReport:
    """Check that PopTorch can train ``model`` on ``inputs``, before spending IPU time.

    Traces like PopTorch (fake tensors: nothing is computed) and returns the report. Raises
    :class:`PopTorchError` for what :func:`trace_like_poptorch` refuses, and with ``strict``
    also for ops PopTorch has no handler for, listing each with the modules it came from.
    """
    report = trace_like_poptorch(model, *inputs).report
    if strict and not report.ok:
        raise PopTorchError(str(report))
    return report
