"""Benchmarks against plain PyTorch and the published unit-scaling library.

`python -m benchmarks` runs them all and writes docs/BENCHMARKS.md; a module with its own
`run(...) -> list[dict]` (such as `cast_throughput`) also prints its table when run alone.
"""
from __future__ import annotations
