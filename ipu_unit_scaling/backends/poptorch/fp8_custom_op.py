"""The FP8 PopART custom ops from Python.

* :func:`fp8_amax_cast`: on an IPU (inside a PopTorch model, ``poptorch.isRunningOnIpu()``)
  it calls ``Fp8AmaxCast``, built from ``custom_ops/``: tile-local amax, scaling bias and cast
  in the Poplar codelets. Everywhere else it runs the host path with the same numerics
  (:func:`ipu_unit_scaling.fp8.cast_to_fp8`: the compiled host cast when built, else torch).
* :class:`PopTorchFP8CustomOps`: the ``Fp8Quantise``, ``Fp8GradientQuantise``,
  ``Fp8GroupQuantise``, ``Fp8GroupGradientQuantise`` and ``ScaledIdentity`` ops, with their
  PopART grad ops, through ``poptorch.custom_op``. It implements
  :class:`ipu_unit_scaling.ops.trace_switch.FP8CustomOps`,
  :class:`~ipu_unit_scaling.ops.trace_switch.GroupQuantiseOps` and
  :class:`ipu_unit_scaling.ops.scaled_identity.ScaledIdentityOp`; the IPU backend passes it to
  ``ipu_tracing(custom_ops=...)`` so that :func:`ipu_unit_scaling.fp8.fp8_quantise`,
  :func:`~ipu_unit_scaling.fp8.fp8_quantise_gradient` and every unit-scaling scale become these
  ops in the traced graph.

PopTorch is imported lazily; importing this module never needs it.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

import torch

__all__ = [
    "DOMAIN", "OP_NAME", "QUANTISE_OP", "GRADIENT_QUANTISE_OP", "SCALED_IDENTITY_OP",
    "DOMAIN_VERSION", "LIBRARY_ENV", "Fp8CastOutputs", "custom_op_library_path",
    "load_custom_op_library", "running_on_ipu", "fp8_amax_cast", "quantise_attributes",
    "scaled_identity_attributes", "PopTorchFP8CustomOps",
]

DOMAIN = "ai.graphcore.unit_scaling"
OP_NAME = "Fp8AmaxCast"
QUANTISE_OP = "Fp8Quantise"
GRADIENT_QUANTISE_OP = "Fp8GradientQuantise"
SCALED_IDENTITY_OP = "ScaledIdentity"
DOMAIN_VERSION = 1
LIBRARY_ENV = "IPU_UNIT_SCALING_CUSTOM_OPS"
_REPO_ROOT = Path(__file__).resolve().parents[3]
_DEFAULT_LIBRARY = _REPO_ROOT / "custom_ops" / "build" / "libfp8_custom_ops.so"

_loaded: Dict[str, ctypes.CDLL] = {}


class Fp8CastOutputs(NamedTuple):
    """The op's outputs: ``codes = encode(x * 2**log2_scale)``.

    ``non_finite`` is 1 when the amax was inf/NaN (then ``log2_scale`` is 0): a vertex cannot
    raise, so on the IPU the flag is returned; the host path raises ``NonFiniteAmaxError``.
    """

    codes: torch.Tensor  # uint8, x's shape
    log2_scale: torch.Tensor  # int32 scalar
    non_finite: torch.Tensor  # int32 scalar


def custom_op_library_path() -> Path:
    """``$IPU_UNIT_SCALING_CUSTOM_OPS``, else ``custom_ops/build/libfp8_custom_ops.so``."""
    configured = os.environ.get(LIBRARY_ENV)
    return Path(configured) if configured else _DEFAULT_LIBRARY


def load_custom_op_library(path: Optional[Path] = None) -> ctypes.CDLL:
    """Load the custom op library, which registers the op with PopART (once per path)."""
    library_path = Path(path) if path is not None else custom_op_library_path()
    key = str(library_path.resolve())
    if key not in _loaded:
        if not library_path.exists():
            raise FileNotFoundError(
                f"{library_path} does not exist. With the Poplar SDK enabled, build it with "
                "`cmake -S custom_ops -B custom_ops/build && cmake --build custom_ops/build`, "
                f"or point {LIBRARY_ENV} at it.")
        _loaded[key] = ctypes.cdll.LoadLibrary(key)
    return _loaded[key]


def running_on_ipu() -> bool:
    """True while PopTorch traces or runs a model for the IPU; False without PopTorch."""
    try:
        import poptorch
    except ImportError:
        return False
    return bool(poptorch.isRunningOnIpu())


def _ipu_cast(x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
              log2_scale: Optional[int]) -> Fp8CastOutputs:
    import poptorch

    load_custom_op_library()
    attributes: Dict[str, Any] = {
        "format": fmt_name,
        "margin": int(margin),
        "saturate": int(saturate),
        "has_log2_scale": int(log2_scale is not None),
        "log2_scale": int(log2_scale or 0),
    }
    example_outputs = [
        torch.zeros(x.shape, dtype=torch.uint8),
        torch.zeros((), dtype=torch.int32),
        torch.zeros((), dtype=torch.int32),
    ]
    codes, scale, non_finite = poptorch.custom_op(
        [x], OP_NAME, DOMAIN, DOMAIN_VERSION, example_outputs=example_outputs,
        attributes=attributes)
    return Fp8CastOutputs(codes, scale, non_finite)


def fp8_amax_cast(
    x: torch.Tensor,
    fmt: object = "F143",
    margin: int = 0,
    overflow: str = "saturate",
    log2_scale: Optional[int] = None,
) -> Fp8CastOutputs:
    """Amax, scaling bias and cast of ``x`` to F143/F152, on the IPU when running on one.

    Same numerics as :func:`ipu_unit_scaling.fp8.cast_to_fp8` (rounding to nearest):
    ``log2_scale=None`` derives ``s`` from the amax with ``margin``; ``overflow`` is
    "saturate" or "nan".
    """
    from ...fp8 import cast_to_fp8, get_format

    fmt_name = get_format(fmt).name  # type: ignore[arg-type]
    if fmt_name not in ("F143", "F152"):
        raise ValueError(f"the FP8 codelets implement F143 and F152, not {fmt_name}")
    if overflow not in ("saturate", "nan"):
        raise ValueError(f"overflow must be 'saturate' or 'nan', got {overflow!r}")
    if running_on_ipu():
        return _ipu_cast(x, fmt_name, margin, overflow == "saturate", log2_scale)
    cast = cast_to_fp8(x, fmt_name, log2_scale=log2_scale, margin=margin, overflow=overflow)
    return Fp8CastOutputs(cast.codes, torch.tensor(cast.log2_scale, dtype=torch.int32),
                          torch.tensor(0, dtype=torch.int32))


def quantise_attributes(fmt_name: str, margin: int, saturate: bool,
                        log2_scale: Optional[int] = None) -> Dict[str, Any]:
    """The PopART attributes of ``Fp8Quantise`` and ``Fp8GradientQuantise``, as
    ``custom_ops/`` reads them (``log2_scale=None``: the scale comes from the amax)."""
    return {
        "format": fmt_name,
        "margin": int(margin),
        "saturate": int(saturate),
        "has_log2_scale": int(log2_scale is not None),
        "log2_scale": int(log2_scale or 0),
    }


def scaled_identity_attributes(fwd_scale: float, bwd_scale: float) -> Dict[str, Any]:
    """The PopART attributes of ``ScaledIdentity``: Python floats, which PopTorch passes as
    float attributes (an int would reach PopART as an int attribute)."""
    return {"fwd_scale": float(fwd_scale), "bwd_scale": float(bwd_scale)}


class PopTorchFP8CustomOps:
    """:class:`ipu_unit_scaling.ops.trace_switch.FP8CustomOps` and ScaledIdentity through
    ``poptorch.custom_op``.

    Each call adds one PopART op to the traced graph; PopART differentiates it with the op's
    grad op (straight through for ``Fp8Quantise``, the AMAX quantise of the gradient for
    ``Fp8GradientQuantise``, ``bwd_scale * dy`` for ``ScaledIdentity``). The library is loaded
    on first use, from ``library_path`` or :func:`custom_op_library_path`. The arguments are
    checked by the callers (:func:`ipu_unit_scaling.fp8.fp8_quantise`), as for the
    ``torch.library`` ops.

    ``poptorch`` names the module to call (the SDK's or the stand-in:
    :func:`ipu_unit_scaling.backends.poptorch_backend.poptorch_module`); ``needs_library`` is
    False for the PopTorch stand-in, which runs these ops with the host numerics the package
    registers with it (:mod:`ipu_unit_scaling.backends.standin_op_library`).

    Unit scaling needs no FP8, so a model may train on an IPU without the library built: then
    :meth:`scaled_identity` gives the composite form (six graph ops instead of one; the same
    gradients, and the same values for finite inputs) and warns once.
    """

    def __init__(self, library_path: Optional[Path] = None, poptorch: str = "poptorch",
                 needs_library: bool = True):
        self.library_path = library_path
        self.poptorch = poptorch  # the name of the poptorch module to call
        self.needs_library = needs_library
        self._warned_composite = False

    def _custom_op(self, x: torch.Tensor, name: str, attributes: Dict[str, Any],
                   example_outputs: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Output 0 of the op; the others (``example_outputs`` beyond the first) stay in the
        graph unread."""
        import importlib

        poptorch = importlib.import_module(self.poptorch)
        if self.needs_library:
            load_custom_op_library(self.library_path)
        # Output 0 has x's shape and dtype; PopTorch only reads the examples' metadata.
        outputs = poptorch.custom_op([x], name, DOMAIN, DOMAIN_VERSION,
                                     example_outputs=example_outputs or [x],
                                     attributes=attributes)
        return outputs[0]

    def quantise(self, x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
                 log2_scale: Optional[int]) -> torch.Tensor:
        return self._custom_op(x, QUANTISE_OP,
                               quantise_attributes(fmt_name, margin, saturate, log2_scale))

    def quantise_gradient(self, x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
                          log2_scale: Optional[int] = None) -> torch.Tensor:
        return self._custom_op(x, GRADIENT_QUANTISE_OP,
                               quantise_attributes(fmt_name, margin, saturate, log2_scale))

    def group_quantise(self, x: torch.Tensor, fmt_name: str, grouping: str, group_size: int,
                       rule: str, scale_rounding: str, margin: int, saturate: bool
                       ) -> torch.Tensor:
        """``Fp8GroupQuantise``'s values (its scales and flags are left in the graph)."""
        from ...fp8.codelet_blocks import GROUP_QUANTISE_OP, group_scale_shape
        from ...fp8.group_cast import Grouping
        from ...fp8.group_cast_ops import group_quantise_attributes

        shape = group_scale_shape(x.shape[0], x.shape[1], Grouping(grouping, group_size))
        scales = torch.zeros(shape, dtype=torch.int32)
        attributes = group_quantise_attributes(fmt_name, grouping, group_size, rule,
                                               scale_rounding, margin, saturate)
        return self._custom_op(x, GROUP_QUANTISE_OP, attributes, [x, scales, scales])

    def group_quantise_gradient(self, x: torch.Tensor, fmt_name: str, grouping: str,
                                group_size: int, rule: str, scale_rounding: str, margin: int,
                                saturate: bool) -> torch.Tensor:
        """``Fp8GroupGradientQuantise``: the identity, whose grad op casts the gradient."""
        from ...fp8.group_cast_ops import GROUP_GRADIENT_QUANTISE_OP, group_quantise_attributes

        return self._custom_op(x, GROUP_GRADIENT_QUANTISE_OP, group_quantise_attributes(
            fmt_name, grouping, group_size, rule, scale_rounding, margin, saturate))

    def scaled_identity(self, x: torch.Tensor, fwd_scale: float, bwd_scale: float
                        ) -> torch.Tensor:
        """``ScaledIdentity``: ``fwd_scale * x``, whose grad op gives ``bwd_scale * dy``."""
        library = Path(self.library_path) if self.library_path else custom_op_library_path()
        if self.needs_library and not library.exists():
            from ...ops.scaled_identity import composite_scale

            if not self._warned_composite:
                self._warned_composite = True
                warnings.warn(
                    f"{library} does not exist, so unit scaling's scales are traced as six "
                    "ops each instead of one ScaledIdentity op (the same gradients); "
                    "build custom_ops/ to get the one-op form", stacklevel=2)
            return composite_scale(x, fwd_scale, bwd_scale)
        return self._custom_op(x, SCALED_IDENTITY_OP,
                               scaled_identity_attributes(fwd_scale, bwd_scale))
