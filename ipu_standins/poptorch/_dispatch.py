"""Dispatch helpers the stand-in's graph ops share."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["below_autograd"]


@contextlib.contextmanager
def below_autograd() -> Iterator[None]:
    """Dispatch below the Autograd key, so that an op's own kernels run (and the tracer records
    the op) instead of its Autograd kernel again."""
    guard = torch._C._AutoDispatchBelowAutograd()
    if hasattr(guard, "__enter__"):  # a context manager from torch 2.1 on
        with guard:
            yield
    else:  # torch 2.0: a guard that is active while the object lives
        try:
            yield
        finally:
            del guard
