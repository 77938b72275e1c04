"""ipu-unit-scaling: unit scaling and FP8-AMAX for PyTorch, IPU-first."""
from __future__ import annotations

__version__ = "0.1.0"
