"""FP8 versions of Hugging Face's ``Conv1D`` (GPT-2's projections: a linear layer whose weight
is stored transposed, (in_features, out_features)) and of ``unit_scale``'s unit-scaled one.

They keep the weight as ``Conv1D`` stores it, under the same name and shape, so a state dict
saved from the model loads into them and back, and they share the original's parameters.
"""
from __future__ import annotations

from typing import Any, Optional, Type, TypeVar

import torch
from torch import nn

from .fp8_config import FP8Config
from .linear import FP8Linear, FP8UnitScaledLinear, ValuesQuantiser

__all__ = ["FP8Conv1D", "FP8UnitScaledConv1D", "is_conv1d"]

_C = TypeVar("_C", bound="FP8Conv1D")


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (found by class name and module, as
    transformers is not imported here)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _from_conv1d(cls: Any, conv: nn.Module, config: Optional[FP8Config],
                 site: str) -> Any:
    weight = conv.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{site}: a Conv1D has a 2-D weight, got {weight!r}")
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = weight.shape
    new.nf = new.out_features  # Conv1D's own names, which Hugging Face code reads
    new.nx = new.in_features
    new.weight = weight
    new.bias = conv.bias
    new.config = config or FP8Config()
    new.site = site
    new.use_scaled_mm = None
    new._add_recipe_state()
    return new


class FP8Conv1D(FP8Linear):
    """``Conv1D`` through FP8 casts: an :class:`FP8Linear` on the transposed weight."""

    @classmethod
    def from_conv1d(cls: Type[_C], conv: nn.Module, config: Optional[FP8Config] = None,
                    site: str = "conv1d") -> _C:
        """An FP8Conv1D sharing ``conv``'s parameters (no copy)."""
        return _from_conv1d(cls, conv, config, site)  # type: ignore[no-any-return]

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()


class FP8UnitScaledConv1D(FP8UnitScaledLinear):
    """``unit_scale``'s unit-scaled ``Conv1D`` through FP8 casts (the scales of ``U.linear``)."""

    @classmethod
    def from_unit_conv1d(cls, conv: nn.Module, constraint: Optional[str],
                         config: Optional[FP8Config] = None,
                         site: str = "conv1d") -> FP8UnitScaledConv1D:
        new: FP8UnitScaledConv1D = _from_conv1d(cls, conv, config, site)
        new.constraint = constraint
        return new

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()

    def values_quantiser(self, x: torch.Tensor) -> Optional[ValuesQuantiser]:
        return None  # the fused blocks read a linear's weight as F.linear takes it
