"""u-μP parameters: a `torch.nn.Parameter` that says what kind of tensor it is.

`Parameter(data, mup_type, mup_scaling_depth=None)` returns a plain `nn.Parameter` carrying two
attributes that u-μP's optimizers read (:mod:`ipu_unit_scaling.optim`):

- `mup_type`: `"weight"` (a hidden or embedding matrix), `"bias"`, `"norm"` (a norm's gain) or
  `"output"` (the readout's weight);
- `mup_scaling_depth`: the number of blocks of the residual stack the parameter belongs to
  (set by `uu.DepthSequential` / `uu.DepthModuleList`), or None outside one.

The object stays an `nn.Parameter` (so `torch.compile`, optimizers and state dicts treat it as
one); the attributes survive `copy.deepcopy` and pickling, which `nn.Parameter` alone does not
guarantee (its `__deepcopy__` builds a fresh parameter from the data only).
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Optional, Protocol

import torch
from torch import Tensor, nn

__all__ = ["MupType", "MUP_TYPES", "Parameter", "ParameterData", "has_parameter_data"]

MupType = Literal["weight", "bias", "norm", "output"]
MUP_TYPES = ("weight", "bias", "norm", "output")


class ParameterData(Protocol):
    """The fields a u-μP parameter carries besides an `nn.Parameter`'s (the type that
    `has_parameter_data` checks for)."""

    mup_type: MupType
    mup_scaling_depth: Optional[int]
    shape: torch.Size

# Instance attributes that make the copies carry the u-μP fields; never pickled themselves.
_HOOKS = ("__deepcopy__", "__reduce_ex__")


def has_parameter_data(parameter: Any) -> bool:
    """Whether `parameter` carries u-μP's fields (a valid `mup_type` and `mup_scaling_depth`)."""
    depth = getattr(parameter, "mup_scaling_depth", 0)
    return (getattr(parameter, "mup_type", None) in MUP_TYPES
            and (depth is None or (isinstance(depth, int) and not isinstance(depth, bool))))


def _deepcopy(self: nn.Parameter, memo: Dict[int, Any]) -> nn.Parameter:
    if id(self) in memo:
        return memo[id(self)]
    data = self.data.clone(memory_format=torch.preserve_format)
    result = Parameter(data, self.mup_type, self.mup_scaling_depth)  # type: ignore[attr-defined]
    result.requires_grad_(self.requires_grad)
    memo[id(self)] = result
    return result


def _rebuild(data: Tensor, requires_grad: bool, state: Dict[str, Any]) -> nn.Parameter:
    result = Parameter(data, state.pop("mup_type"), state.pop("mup_scaling_depth", None))
    result.requires_grad_(requires_grad)
    for name, value in state.items():
        setattr(result, name, value)
    return result


def _reduce_ex(self: nn.Parameter, protocol: int) -> Any:
    state = {k: v for k, v in torch._utils._get_obj_state(self).items() if k not in _HOOKS}
    return _rebuild, (self.data, self.requires_grad, state)


def Parameter(  # noqa: N802 - a constructor, named as the library names it
    data: Tensor, mup_type: str, mup_scaling_depth: Optional[int] = None
) -> nn.Parameter:
    """An `nn.Parameter` of `data` tagged with u-μP's `mup_type` and `mup_scaling_depth`."""
    if mup_type not in MUP_TYPES:
        raise ValueError(f"mup_type={mup_type!r} must be one of {MUP_TYPES}")
    parameter = nn.Parameter(data)
    parameter.mup_type = mup_type  # type: ignore[attr-defined]
    parameter.mup_scaling_depth = mup_scaling_depth  # type: ignore[attr-defined]
    # Bound to this object: `copy` and `pickle` look these up on the instance first.
    parameter.__deepcopy__ = _deepcopy.__get__(parameter)  # type: ignore[method-assign]
    parameter.__reduce_ex__ = _reduce_ex.__get__(parameter)  # type: ignore[method-assign]
    return parameter

