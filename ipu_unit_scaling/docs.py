"""Arguments taken for torch's sake but not implemented (unit-scaling's ``unit_scaling.docs``
path; written in :mod:`ipu_unit_scaling.ops.torch_arguments`).
"""
from __future__ import annotations

from .ops.torch_arguments import *  # noqa: F403
from .ops.torch_arguments import __all__  # noqa: F401

# unit-scaling's tests import `unit_scaling.docs._validate`.
from .ops.torch_arguments import validate_arguments as _validate  # noqa: F401
