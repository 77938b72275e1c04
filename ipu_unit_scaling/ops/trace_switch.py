"""The one switch between the eager form and the PopTorch form of every op.

PopTorch traces a model's forward pass to ATen ops and lets PopART differentiate that graph:
a ``torch.autograd.Function``'s ``backward`` is never run, ``.item()`` is refused and float8
tensors cannot cross into the graph. Every op in this package therefore has two forms:

- the eager form (the default): fast on the CPU, custom autograd Functions allowed;
- the traced form (inside :func:`ipu_tracing`): built only from differentiable forward ops
  PopTorch supports, and from FP8 custom ops that carry their own gradient definitions.

Ops ask :func:`is_ipu_tracing` once per call; nothing else chooses between the forms.

The FP8 custom ops have two implementations of the same numerics: the ``torch.library`` ops
(see :mod:`ipu_unit_scaling.fp8.cast_ops`, used on the CPU and by the emulator) and PopTorch's
``poptorch.custom_op`` calls into the PopART ops built from ``custom_ops/`` (used when the IPU
backend traces). The IPU backend passes its implementation to :func:`ipu_tracing`, so nothing
outside the backend layer imports poptorch. An implementation that also has the grouped casts
of the rowwise, block and MX recipes is a :class:`GroupQuantiseOps` (see
:mod:`ipu_unit_scaling.fp8.group_cast_ops`).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator, List, Optional, Protocol, runtime_checkable

import torch

__all__ = ["FP8CustomOps", "GroupQuantiseOps", "ipu_tracing", "is_ipu_tracing",
           "fp8_custom_ops"]


class FP8CustomOps(Protocol):
    """One implementation of the two FP8 custom ops (see :mod:`ipu_unit_scaling.fp8.cast_ops`)."""

    def quantise(self, x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
                 log2_scale: Optional[int]) -> torch.Tensor:
        """``decode(cast(x * 2**s)) * 2**-s`` in x's dtype; the gradient passes straight through."""
        ...

    def quantise_gradient(self, x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
                          log2_scale: Optional[int] = None) -> torch.Tensor:
        """The identity; its gradient is quantised as :meth:`quantise` does (AMAX scaling when
        ``log2_scale`` is None)."""
        ...


@runtime_checkable
class GroupQuantiseOps(Protocol):
    """The grouped casts' two custom ops (``Fp8GroupQuantise`` and
    ``Fp8GroupGradientQuantise``), in an implementation that has them: each casts a 2-D tensor
    with one scale per group of ``grouping`` ("row", "tile" or "block", ``group_size`` wide)
    along its last dimension."""

    def group_quantise(self, x: torch.Tensor, fmt_name: str, grouping: str, group_size: int,
                       rule: str, scale_rounding: str, margin: int, saturate: bool
                       ) -> torch.Tensor:
        """The grouped cast's values in x's dtype; the gradient passes straight through."""
        ...

    def group_quantise_gradient(self, x: torch.Tensor, fmt_name: str, grouping: str,
                                group_size: int, rule: str, scale_rounding: str, margin: int,
                                saturate: bool) -> torch.Tensor:
        """The identity; its gradient is cast as :meth:`group_quantise` casts."""
        ...


class _TracingFrame:
    def __init__(self, custom_ops: Optional[FP8CustomOps]):
        self.custom_ops = custom_ops


_frames: List[_TracingFrame] = []


@contextlib.contextmanager
def ipu_tracing(custom_ops: Optional[FP8CustomOps] = None) -> Iterator[None]:
    """Inside this context every op, module, FP8 cast and precision simulation of the package
    takes its PopTorch form: gradients come from the forward graph alone, no host
    synchronisation, no float8 tensors, only ops PopTorch supports.

    ``custom_ops`` implements the FP8 custom ops; None uses the ``torch.library`` ops, which
    run anywhere with the same numerics as the PopART ops. Contexts nest; the innermost wins.
    """
    _frames.append(_TracingFrame(custom_ops))
    try:
        yield
    finally:
        _frames.pop()


def is_ipu_tracing() -> bool:
    """Whether ops must take their PopTorch form now: inside :func:`ipu_tracing`, or while a
    program's ``poptorch`` (the SDK's, or the stand-in under ``ipu-unit-scaling emulate``)
    traces a model (``poptorch.isRunningOnIpu()``)."""
    if _frames:
        return True
    poptorch = sys.modules.get("poptorch")  # only a program's own import: never imported here
    return poptorch is not None and bool(poptorch.isRunningOnIpu())


def fp8_custom_ops() -> Optional[FP8CustomOps]:
    """The FP8 custom-op implementation of the innermost :func:`ipu_tracing`, if it set one."""
    return _frames[-1].custom_ops if _frames else None
