"""The one ``torch.library`` library of the package's custom ops (namespace ``ipu_unit_scaling``).

Every module that registers an op (:mod:`ipu_unit_scaling.fp8.cast_ops`,
:mod:`ipu_unit_scaling.ops.scaled_identity`) defines it on :data:`LIBRARY`: torch 2.0 knows only
the ``DEF`` kind, which claims a namespace for a single library object, so a second library of
the same namespace would be refused there.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["NAMESPACE", "LIBRARY", "below_autograd"]

NAMESPACE = "ipu_unit_scaling"


def _new_library() -> torch.library.Library:
    # FRAGMENT (torch 2.1 on) leaves the namespace open to other libraries too.
    try:
        return torch.library.Library(NAMESPACE, "FRAGMENT")
    except ValueError:
        return torch.library.Library(NAMESPACE, "DEF")


LIBRARY = _new_library()


@contextlib.contextmanager
def below_autograd() -> Iterator[None]:
    """Dispatch below the Autograd key, so an op's own kernels run (and tracers record the op)
    instead of its Autograd kernel again."""
    guard = torch._C._AutoDispatchBelowAutograd()
    if hasattr(guard, "__enter__"):  # a context manager from torch 2.1 on
        with guard:
            yield
    else:  # torch 2.0: a guard that is active while the object lives
        try:
            yield
        finally:
            del guard
