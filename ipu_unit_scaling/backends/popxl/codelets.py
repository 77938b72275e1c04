"""The FP8 codelets as a PopXL custom op: tile-local amax, scaling bias and cast in one op.

``popxl_fp8_amax_cast(xl, x, fmt, margin, saturate) -> (codes, log2_scale, non_finite)``: codes a
``float8_143`` / ``float8_152`` tensor (``cast(x * 2**s)``), ``log2_scale`` and ``non_finite``
int32 scalars, the codelets' ScalingBias vertex's outputs (a non-finite amax gives 0 and 1).

On PopXL it is the op ``Fp8AmaxCastFloat8`` of ``custom_ops/popxl_fp8_amax_cast.cpp``, a
Python extension module that :func:`load_binding` builds with cppimport on first use and
creates in the graph as PopXL's user guide does for custom ops (``create_op_in_graph`` of its
ParameterizedOp bindings, cppimport, pybind11 2.6.2: the release ``popart._internal.ir`` is
built with, whose types the binding's functions take). On the PopXL stand-in
(:mod:`ipu_standins.popxl`) the same vertices run on the host, through
:mod:`ipu_unit_scaling.fp8.codelets_on_host`, over a few tiles (the result does not depend on
the split; ``tests/fp8/test_codelets_on_host.py`` shows it).
"""
from __future__ import annotations

import builtins
import importlib.util
import os
from pathlib import Path
from typing import Any, Set, Tuple

import torch

from ...fp8.fp8_formats import FP8Format

__all__ = ["POPXL_OP_NAME", "popxl_fp8_amax_cast", "binding_path", "load_binding",
           "pybind11_internals", "check_shared_internals"]

POPXL_OP_NAME = "Fp8AmaxCastFloat8"  # in domain "ai.graphcore.unit_scaling", version 1
MODULE_NAME = "ius_popxl_ops"  # the PYBIND11_MODULE name
BINDING_ENV = "IPU_UNIT_SCALING_POPXL_OPS"
SOURCE = Path(__file__).resolve().parents[3] / "custom_ops" / "popxl_fp8_amax_cast.cpp"
POPART_PYBIND11 = "2.6.2"  # the pybind11 release PopART's Python bindings are built with
_STAND_IN_TILES = 16  # the host run's split, for the stand-in only

Tensor = Any


def fp8_dtype(xl: Any, fmt: FP8Format) -> Any:
    """The PopXL dtype of an IPU FP8 format (the OCP formats have none)."""
    if fmt.name == "F143":
        return xl.float8_143
    if fmt.name == "F152":
        return xl.float8_152
    raise ValueError(f"PopXL has no FP8 dtype for {fmt.name}; use F143 or F152")


def popxl_fp8_amax_cast(xl: Any, x: Tensor, fmt: FP8Format, margin: int, saturate: bool
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    import ipu_standins.popxl as standin

    if xl is standin:
        return _stand_in(x, fmt, margin, saturate)
    return _popxl(x, fmt, margin, saturate)


def binding_path() -> Path:
    """A built module named by ``$IPU_UNIT_SCALING_POPXL_OPS``, else the C++ source that
    cppimport builds; ImportError, saying what to install, when it cannot be built here."""
    override = os.environ.get(BINDING_ENV)
    if override:
        return Path(override)
    try:
        import cppimport  # noqa: F401
        import pybind11
    except ImportError:
        raise ImportError(
            "the PopXL binding of the codelets is built with cppimport, as in PopXL's custom-op "
            f"guide: pip install cppimport pybind11=={POPART_PYBIND11} (or set {BINDING_ENV} to "
            "a built module, or use amax='ops')") from None
    if pybind11.__version__ != POPART_PYBIND11:
        raise ImportError(
            f"the PopXL binding must be built with pybind11 {POPART_PYBIND11}, the release "
            f"popart._internal.ir is built with, not {pybind11.__version__}: "
            f"pip install pybind11=={POPART_PYBIND11}")
    return SOURCE


def pybind11_internals() -> Set[str]:
    """The pybind11 type registries loaded so far (one per incompatible pybind11 build)."""
    return {name for name in vars(builtins) if name.startswith("__pybind11_internals_")}


def check_shared_internals(popart_internals: Set[str], after_loading: Set[str],
                           module: Path) -> None:
    """ImportError when loading the binding created a pybind11 registry of its own: its
    functions would then not accept popart._internal.ir's objects (a graph, a tensor)."""
    new = sorted(after_loading - popart_internals)
    if popart_internals and new:
        raise ImportError(
            f"{module} was built with a pybind11 whose internals ({', '.join(new)}) differ from "
            f"popart._internal.ir's ({', '.join(sorted(popart_internals))}); rebuild it with "
            f"pybind11 {POPART_PYBIND11}")


def load_binding() -> Any:
    import popart._internal.ir  # noqa: F401  (registers the types the binding takes)

    before = pybind11_internals()
    path = binding_path()
    if path == SOURCE:
        import cppimport

        module = cppimport.imp_from_filepath(str(path), MODULE_NAME)
    else:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    check_shared_internals(before, pybind11_internals(), path)
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
    op = getattr(binding, POPXL_OP_NAME).create_op_in_graph(
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
    import ipu_standins.popxl as standin
    from ipu_standins.popxl_custom_ops import add_op

    from ...fp8 import codelets_on_host as on_host

    overflow = "saturate" if saturate else "nan"

    def run(values: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        layout = on_host.flat_mapping(values.numel(), _STAND_IN_TILES)
        partials = on_host.partial_amaxes(values, mapping=layout)
        reduction = on_host.reduce_amax(partials, on_host.leaf_tiles(layout), fmt, margin)
        scale, non_finite = reduction.log2_scale, reduction.non_finite
        cast = on_host.cast_to_fp8_vertices(values, fmt, scale, overflow=overflow, mapping=layout)
        return (cast.codes, torch.tensor(scale, dtype=torch.int32),
                torch.tensor(int(non_finite), dtype=torch.int32))

    codes, scale, non_finite = add_op(
        "fp8_amax_cast", run, [x], [fp8_dtype(standin, fmt), standin.int32, standin.int32])
    return codes, scale, non_finite
