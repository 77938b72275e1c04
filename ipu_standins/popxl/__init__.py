"""A torch stand-in for the subset of PopXL that the PopXL backend of ``ipu_unit_scaling`` uses.

This is **not PopXL**. It implements, in torch on the CPU, exactly the ``popxl`` /
``popxl.ops`` / ``popxl.transforms`` names the PopXL model code calls, each following the
semantics PopXL documents, so that the same model code can be run and tested without the
Poplar SDK, the way ``codelets/host_shim`` stands in for ``poplar/Vertex.hpp``. Every function
cites its source: a path in Graphcore's ``popart`` repository (``python/popxl/python_files/...``
for the Python API and its docstrings, ``docs/popxl/...`` for the user guide, ``willow/...`` for
the C++ ops behind them).

What it does not do, and real PopXL does: compile for an IPU, schedule, alias, in-place
transforms, recomputation, replication. Execution here is eager and in creation order, which
is at least as strict as ``popxl.in_sequence(True)``. Differences that matter for numerics:

- ``matmul_pow2scaled`` accumulates the exact FP8 products in float32 and rounds once to
  float16; the IPU accumulates in half-precision partials (the PopART source forces
  ``MatMulPartialsType.HALF``), which can differ in the last bits of the float16 result.
- ``autodiff`` returns a gradient graph that recomputes its forward graph from the forward
  graph's inputs and differentiates it with torch autograd; PopART stitches stored forward
  tensors instead. The values are the same; only the expected inputs differ, and callers that
  use ``GradGraphInfo.inputs_dict`` (as documented) do not see the difference.
- An FP8 device cast that overflows gives NaN (what ``host_pow2scale_cast_to_fp8`` does by
  default, ``nan_on_overflow=True``, and what the IPU does with NaN-on-overflow set).

The module exposes only names real PopXL exposes in the same place: its top level,
``tensor`` (``Variable`` and ``Constant`` are there only), ``ops`` and ``transforms``.
Stand-in only, for tests, with no PopXL counterpart: ``Session.keep_values = True`` makes
``Session.values`` hold every tensor value the last run computed (tests read intermediate FP8
codes from it), and ``with ipu_standins.popxl_settings.fp8_matmul_output(torch.float32):`` (a module
of its own, outside the PopXL namespace) makes ``matmul_pow2scaled`` return its float32 sum
unrounded, which is what ``transforms.simulate_fp8`` computes.
"""
from __future__ import annotations

from typing import List

from . import _ops as ops
from . import _tensor as tensor  # noqa: F401  (popxl.tensor)
from . import _transforms as transforms
from ._core import *  # noqa: F403
from ._core import __all__ as _CORE_NAMES

# Only names real PopXL has at its top level (popart: python/popxl/__init__.py.in), plus its
# submodules ops, transforms and tensor; Variable and Constant live in `tensor`, as there.
__all__ = [*_CORE_NAMES, "ops", "transforms"]


def __dir__() -> List[str]:
    return sorted(__all__ + ["tensor"])
