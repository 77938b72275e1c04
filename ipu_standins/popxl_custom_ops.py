"""Host ops for the PopXL stand-in, where a program on PopXL would add a custom op.

On PopXL a program binds its op library's ops with their C++ bindings; the stand-in has no
PopART, so an op library adds the op's host numerics to the current graph with :func:`add_op`
instead: ``add_op(name, run, inputs, output_dtypes)`` records an op whose outputs are
``run(*input_values)``, run in creation order with the graph's other ops.
"""
from __future__ import annotations

from .popxl._core import add_op

__all__ = ["add_op"]
