"""Settings of the PopXL stand-in (:mod:`ipu_standins.popxl`) that PopXL itself does not have.

They live outside the stand-in's namespace, which holds only names real PopXL has.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

__all__ = ["fp8_matmul_output", "fp8_matmul_output_dtype"]

_fp8_matmul_output: List[torch.dtype] = [torch.float16]


@contextlib.contextmanager
def fp8_matmul_output(dtype: torch.dtype) -> Iterator[None]:
    """Inside, the stand-in's ``matmul_pow2scaled`` rounds its result to ``dtype`` instead of
    float16. It separates PopXL's float16 matmul output from everything else when comparing
    with ``simulate_fp8``."""
    _fp8_matmul_output.append(dtype)
    try:
        yield
    finally:
        _fp8_matmul_output.pop()


def fp8_matmul_output_dtype() -> torch.dtype:
    """What ``matmul_pow2scaled`` rounds to now."""
    return _fp8_matmul_output[-1]
