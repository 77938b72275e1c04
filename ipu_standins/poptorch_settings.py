"""Settings of the PopTorch stand-in that PopTorch itself does not have.

They live outside the stand-in's namespace, which holds only names PopTorch has.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["torch_numerics", "follows_ipu_numerics"]

_torch_numerics_depth = [0]


@contextlib.contextmanager
def torch_numerics() -> Iterator[None]:
    """Inside, traced graphs compute each op as eager torch defines it: the stand-in does not
    lower GELU to PopART's nor round casts to half stochastically. For checking traced forms
    against eager torch apart from what PopART computes differently."""
    _torch_numerics_depth[0] += 1
    try:
        yield
    finally:
        _torch_numerics_depth[0] -= 1


def follows_ipu_numerics() -> bool:
    """Whether traces compute what an IPU computes (outside :func:`torch_numerics`)."""
    return _torch_numerics_depth[0] == 0
