"""The FP8 codelets as a PopXL custom op: tile-local amax, scaling bias and cast in one op.

``fp8_amax_cast(xl, x, fmt, margin, saturate) -> (codes, log2_scale, non_finite)``: codes a
``float8_143`` / ``float8_152`` tensor (``cast(x * 2**s)``), ``log2_scale`` and ``non_finite``
int32 scalars, the codelets' ScalingBias vertex's outputs (a non-finite amax gives 0 and 1).

On PopXL it is the op ``Fp8AmaxCastFloat8`` of ``custom_ops/popxl_fp8_amax_cast.cpp``, a
Python extension module built with ``cmake --build custom_ops/build --target ius_popxl_ops``
and created in the graph the way PopXL's user guide creates custom ops (``create_op_in_graph``
of its ParameterizedOp bindings). On the stand-in (:mod:`.reference`) the same vertices run on
the host, through :mod:`ipu_unit_scaling.emulator`, over a few tiles (the result does not
depend on the split; ``tests/test_emulator.py`` shows it).
"""
from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path
from typing import Any, Tuple

import torch

from ..fp8.formats import FP8Format
from .fp8_ops import fp8_dtype

__all__ = ["OP_NAME", "fp8_amax_cast", "binding_path", "load_binding"]

OP_NAME = "Fp8AmaxCastFloat8"  # in domain "ai.graphcore.unit_scaling", version 1
BINDING_ENV = "IPU_UNIT_SCALING_POPXL_OPS"
_STAND_IN_TILES = 16  # the emulator's split, for the stand-in only

Tensor = Any


def fp8_amax_cast(xl: Any, x: Tensor, fmt: FP8Format, margin: int, saturate: bool
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    from . import reference

    if xl is reference:
        return _stand_in(x, fmt, margin, saturate)
    return _popxl(x, fmt, margin, saturate)


def binding_path() -> Path:
    """The built extension module: ``$IPU_UNIT_SCALING_POPXL_OPS``, else the CMake build's."""
    override = os.environ.get(BINDING_ENV)
    if override:
        return Path(override)
    build = Path(__file__).resolve().parents[2] / "custom_ops" / "build"
    found = sorted(glob.glob(str(build / "ius_popxl_ops*.so")))
    if not found:
        raise ImportError(
            f"the PopXL binding of the codelets is not built (no ius_popxl_ops*.so in {build}); "
            f"build it with `cmake --build custom_ops/build --target ius_popxl_ops`, or set "
            f"{BINDING_ENV}, or use amax='ops'")
    return Path(found[-1])


def load_binding() -> Any:
    path = binding_path()
    spec = importlib.util.spec_from_file_location("ius_popxl_ops", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _popxl(x: Tensor, fmt: FP8Format, margin: int, saturate: bool
           ) -> Tuple[Tensor, Tensor, Tensor]:
    from popxl.context import get_current_context
    from popxl.ops.utils import check_in_graph
    from popxl.tensor import Tensor as PopXLTensor

    binding = load_binding()
    context = get_current_context()
    graph = context.graph
    check_in_graph(graph, x=x)
    op = getattr(binding, OP_NAME).create_op_in_graph(
        graph=graph._pb_graph,
        inputs={0: x.id},
        outputs={i: graph._create_tensor_id(name)
                 for i, name in enumerate(("fp8_codes", "log2_scale", "non_finite"))},
        params=binding.Fp8AmaxCastParams(format=fmt.name, margin=margin, saturate=saturate),
        settings=context._get_op_settings("fp8_amax_cast"),
    )
    context._op_created(op)  # PopXL's transforms (in_sequence, ...) see the new op
    return tuple(PopXLTensor._from_pb_tensor(op.outTensor(i)) for i in range(3))  # type: ignore


def _stand_in(x: Tensor, fmt: FP8Format, margin: int, saturate: bool
              ) -> Tuple[Tensor, Tensor, Tensor]:
    from .. import emulator
    from . import reference

    overflow = "saturate" if saturate else "nan"

    def run(values: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        partials = emulator.partial_amaxes(values, _STAND_IN_TILES)
        scale, non_finite = emulator.scaling_bias(partials, fmt, margin)
        cast = emulator.cast_to_fp8(values, fmt, scale, overflow=overflow, tiles=_STAND_IN_TILES)
        return (cast.codes, torch.tensor(scale, dtype=torch.int32),
                torch.tensor(int(non_finite), dtype=torch.int32))

    codes, scale, non_finite = reference._add_op(
        "fp8_amax_cast", run, [x], [fp8_dtype(reference, fmt), reference.int32, reference.int32])
    return codes, scale, non_finite
