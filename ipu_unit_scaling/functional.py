"""``U``: the unit-scaled counterparts of ``torch.nn.functional``.

``import ipu_unit_scaling.functional as U``, as with unit-scaling's ``unit_scaling.functional``.
The ops are written in the ops layer (:mod:`ipu_unit_scaling.ops`); this is their public path.
"""
from __future__ import annotations

from .ops import *  # noqa: F403
from .ops import __all__  # noqa: F401

# unit-scaling's map from torch's functions to these ops (not in __all__, as there).
from .ops.torch_counterparts import torch_map  # noqa: F401, E402
