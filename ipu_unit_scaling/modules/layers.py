"""Unit-scaled modules, a drop-in for `torch.nn`: `import ipu_unit_scaling as uu`.

Leaf modules subclass their torch counterparts (so `isinstance(m, nn.Linear)` still holds and
state dicts are interchangeable), unit-initialise their weights, and call `U` in `forward`. Their
signatures and defaults are those of the unit-scaling library (0.3.5), whose models run on them
unchanged: `mult` for u-μP's multipliers, parameters tagged with their u-μP type, biases and
norm gains off by default.

The GPT blocks here (`SelfAttention`, `FeedForward`, `TransformerBlock`, `GPT`) are written once
against an `Ops` table. `UNIT_OPS` (the default) builds them from unit-scaled parts; `TORCH_OPS`
builds the same architecture from plain torch modules at their default initialisation, which
is what unit scaling is compared against. unit_scaling's own u-μP blocks (`MHSA`, `MLP`,
`TransformerLayer`, `TransformerDecoder`) are in `ipu_unit_scaling.modules.depth_blocks`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops as U
from ..ops import loss_ops, rule_switch
from ..ops.scale_constraints import ConstraintArg
from ..ops.scaling_primitive import scale_bwd
from ..ops.torch_arguments import unsupported
from .mup_parameter import MupType, Parameter

__all__ = [
    "Linear",
    "LinearReadout",
    "Conv1d",
    "AttentionProjection",
    "LayerNorm",
    "Embedding",
    "GELU",
    "ReLU",
    "Softmax",
    "Dropout",
    "CrossEntropyLoss",
    "RMSNorm",
    "SiLU",
]


@dataclass(frozen=True)
class AttentionProjection:
    """Marks a linear whose output is only the queries, keys or values (`role`) of one
    unit-scaled attention call, for the gradient rules that attention sets on that linear's
    parameters (cut edges: nothing upstream changes):

    - queries and keys: weight and bias gradients times `U.attention_query_key_grad_scale`
      (the gradient through softmax's Jacobian falls short of unit, most for few keys);
    - values: the bias gradient times `U.attention_value_bias_grad_scale` (a value bias meets
      attention's row scale).

    The attention's settings that set these: dropout (as in training), causal or not, and the
    logits' std (`scale * sqrt(head_dim)`, 1 for the default scale).
    """

    role: str
    dropout_p: float = 0.0
    is_causal: bool = False
    logit_std: float = 1.0

    def __post_init__(self) -> None:
        if self.role not in ("query", "key", "value"):
            raise ValueError(f"role must be 'query', 'key' or 'value', got {self.role!r}")

    def weight_grad_scale(self, key_len: int) -> float:
        if self.role == "value":
            return 1.0
        return U.attention_query_key_grad_scale(key_len, self.is_causal, self.logit_std)

    def bias_grad_scale(self, key_len: int) -> float:
        if self.role == "value":
            return U.attention_value_bias_grad_scale(
                key_len, self.dropout_p, self.is_causal, self.logit_std
            )
        return self.weight_grad_scale(key_len)


class Linear(nn.Linear):
    """Unit-scaled `nn.Linear`: weight ~ N(0, 1), zero bias, forward `U.linear`.

    As in unit_scaling, the bias is off by default and the weight and bias are u-μP parameters
    (`ipu_unit_scaling.parameter.Parameter`, of type `weight_mup_type` and "bias").

    `attention_projection` (an `AttentionProjection`, set by `unit_scale` on a linear that only
    feeds an attention call's queries, keys or values): its weight and bias gradients are also
    scaled by the rule's `weight_grad_scale` and `bias_grad_scale`, for a key length read from
    the input's second-to-last dimension (the positions, as in (batch, keys, features)); not
    under `rules("unit-scaling")`, whose linears have no such rule.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        constraint: ConstraintArg = "to_output_scale",
        weight_mup_type: MupType = "weight",
        attention_projection: Optional[AttentionProjection] = None,
    ) -> None:
        self.constraint = constraint
        self.attention_projection = attention_projection
        super().__init__(in_features, out_features, bias, device, dtype)
        self.weight = Parameter(self.weight.data, weight_mup_type)
        if self.bias is not None:
            self.bias = Parameter(self.bias.data, "bias")

    scale_power = (0.5, 0.5, 0.5)  # `U.linear`'s exponents, for other forms of this layer

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        weight: Tensor = self.weight
        bias: Optional[Tensor] = self.bias
        # Absent from instances pickled before it.
        rule = getattr(self, "attention_projection", None)
        if rule is not None and input.dim() >= 2 and not rule_switch.library_rules():
            key_len = input.shape[-2]
            weight_scale = rule.weight_grad_scale(key_len)
            if weight_scale != 1.0:
                weight = scale_bwd(weight, weight_scale)
            if bias is not None:
                bias = scale_bwd(bias, rule.bias_grad_scale(key_len))
        return U.linear(input, weight, bias, self.constraint)


class LinearReadout(Linear):
    """Unit-scaled linear for a network's output: forward `U.linear_readout` (output scale
    `1 / fan_in`, u-μP's readout), weight of u-μP type "output", unconstrained by default."""

    scale_power = (1.0, 0.5, 0.5)  # `U.linear`'s exponents, for other forms of this layer

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        constraint: ConstraintArg = None,
        weight_mup_type: MupType = "output",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype, constraint,
                         weight_mup_type)

    def forward(self, input: Tensor) -> Tensor:
        return U.linear_readout(input, self.weight, self.bias, self.constraint)


class Conv1d(nn.Conv1d):
    """Unit-scaled `nn.Conv1d` (integer padding): weight ~ N(0, 1), zero bias (off by
    default), forward `U.conv1d`; the weight and bias are u-μP parameters."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = False,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        constraint: ConstraintArg = "to_output_scale",
        weight_mup_type: MupType = "weight",
    ) -> None:
        for name, value in (("kernel_size", kernel_size), ("stride", stride),
                            ("padding", padding), ("dilation", dilation)):
            if not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: the unit-scaled Conv1d takes integers")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)  # type: ignore[arg-type]
        self.constraint = constraint
        self.weight = Parameter(self.weight.data, weight_mup_type)
        if self.bias is not None:
            self.bias = Parameter(self.bias.data, "bias")

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        padding = self.padding[0] if isinstance(self.padding, tuple) else self.padding
        if self.padding_mode != "zeros":
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        return U.conv1d(input, self.weight, self.bias, self.stride[0], int(padding),
                        self.dilation[0], self.groups, self.constraint)


class LayerNorm(nn.LayerNorm):
    """Unit-scaled `nn.LayerNorm`: forward `U.layer_norm`.

    As in unit_scaling, without a gain and bias by default (`elementwise_affine=False`); with
    them, they are u-μP parameters of type "norm" and "bias".
    """

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = False,
        bias: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        # torch 2.0's LayerNorm has no `bias` argument: drop the parameter after.
        super().__init__(normalized_shape, eps, elementwise_affine,  # type: ignore[arg-type]
                         device=device, dtype=dtype)
        if elementwise_affine:
            self.weight = Parameter(self.weight.data, "norm")
            if bias:
                self.bias = Parameter(self.bias.data, "bias")
            else:
                self.register_parameter("bias", None)

    def forward(self, input: Tensor) -> Tensor:
        return U.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


@unsupported("scale_grad_by_freq", "sparse")
def _checked_embedding_arguments(scale_grad_by_freq: bool = False, sparse: bool = False) -> None:
    pass


class Embedding(nn.Embedding):
    """Unit-scaled `nn.Embedding`: weight ~ N(0, 1) (torch's default) of u-μP type "weight",
    forward `U.embedding`. `scale_grad_by_freq` and `sparse` are refused."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[Tensor] = None,
        _freeze: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        _checked_embedding_arguments(scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        # torch 2.0's Embedding has no `_freeze`: it only turns off the weight's gradient.
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                         scale_grad_by_freq, sparse, _weight, device=device, dtype=dtype)
        self.weight = Parameter(self.weight.data, "weight")
        if _freeze:
            self.weight.requires_grad_(False)

    def forward(self, input: Tensor) -> Tensor:
        return U.embedding(
            input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
            self.scale_grad_by_freq, self.sparse,
        )


def _split_mult(mult: Any, constraint: ConstraintArg) -> Tuple[float, ConstraintArg]:
    """(mult, constraint) from a second argument that may be a constraint, as some modules'
    second argument was before they took u-μP's `mult`."""
    if mult is None or isinstance(mult, str) or callable(mult):
        return 1.0, mult
    return float(mult), constraint


class GELU(nn.GELU):
    """Unit-scaled `nn.GELU` of `mult * input` (see `U.gelu`). `GELU("tanh")` (the
    approximation given first, as earlier versions took it) is still understood."""

    def __init__(self, mult: Union[float, str] = 1.0,
                 constraint: ConstraintArg = "to_output_scale", approximate: str = "none") -> None:
        if isinstance(mult, str):
            approximate = mult
        super().__init__(approximate)
        self.mult = 1.0 if isinstance(mult, str) else float(mult)
        self.constraint = constraint

    def forward(self, input: Tensor) -> Tensor:
        return U.gelu(input, self.mult, self.constraint, self.approximate)


class ReLU(nn.ReLU):
    """Unit-scaled `nn.ReLU`."""

    def __init__(self, inplace: bool = False,
                 constraint: ConstraintArg = "to_output_scale") -> None:
        super().__init__(inplace)
        self.constraint = constraint

    def forward(self, input: Tensor) -> Tensor:
        return U.relu(input, self.inplace, self.constraint)


class Softmax(nn.Softmax):
    """Unit-scaled `nn.Softmax` of `mult * input` (see `U.softmax`). A constraint given
    second (as earlier versions took it) is still understood."""

    def __init__(self, dim: int = -1, mult: Union[float, ConstraintArg] = 1.0,
                 constraint: ConstraintArg = "to_output_scale") -> None:
        super().__init__(dim)
        self.mult, self.constraint = _split_mult(mult, constraint)

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim if self.dim is not None else -1
        return U.softmax(input, dim, None, self.constraint, getattr(self, "mult", 1.0))


class Dropout(nn.Dropout):
    """Unit-scaled `nn.Dropout` (not in place)."""

    @unsupported("inplace")
    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__(p, inplace)

    def forward(self, input: Tensor) -> Tensor:
        return U.dropout(input, self.p, self.training, self.inplace)


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Unit-scaled `nn.CrossEntropyLoss`: the same loss value, unit-scaled input gradient;
    `mult` multiplies the logits in the forward pass (see `U.cross_entropy`). Class weights and
    label smoothing are refused."""

    @unsupported("weight", "label_smoothing")
    def __init__(
        self,
        mult: float = 1.0,
        weight: Optional[Tensor] = None,
        size_average: Optional[bool] = None,
        ignore_index: int = -100,
        reduce: Optional[bool] = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.mult = mult

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        # A label smoothing is only set by `unit_scale` (see `loss_ops.smoothed_cross_entropy`).
        return loss_ops.smoothed_cross_entropy(input, target, None, self.ignore_index,
                                               self.reduction, self.label_smoothing,
                                               getattr(self, "mult", 1.0))


class SiLU(nn.SiLU):
    """Unit-scaled SiLU `x * sigmoid(mult * x)` (see `U.silu`), not in place."""

    def __init__(self, mult: Union[float, bool] = 1.0,
                 constraint: ConstraintArg = "to_output_scale", inplace: bool = False) -> None:
        if isinstance(mult, bool):  # SiLU(inplace) as earlier versions took it
            inplace = mult
        if inplace:
            raise ValueError("SiLU: inplace=True is not supported by the unit-scaled version")
        super().__init__(inplace)
        self.mult = 1.0 if isinstance(mult, bool) else float(mult)
        self.constraint = constraint

    def forward(self, input: Tensor) -> Tensor:
        return U.silu(input, getattr(self, "mult", 1.0), self.constraint)


class _RMSNormFallback(nn.Module):
    """`nn.RMSNorm`'s attributes and state, for torch before 2.4 (which has no RMSNorm)."""

    def __init__(self, normalized_shape: Union[int, Tuple[int, ...]], eps: Optional[float] = None,
                 elementwise_affine: bool = True, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device,
                                                  dtype=dtype))
        else:
            self.register_parameter("weight", None)


_RMSNormBase: Any = getattr(nn, "RMSNorm", _RMSNormFallback)


class RMSNorm(_RMSNormBase):  # type: ignore[misc]  # nn.RMSNorm where torch has it (>= 2.4)
    """Unit-scaled `nn.RMSNorm`: forward `U.rms_norm`.

    As in unit_scaling, `eps` is 1e-5 and there is no gain by default
    (`elementwise_affine=False`); with one, it is a u-μP parameter of type "norm". `eps=None`
    is torch's default, the input dtype's machine epsilon.
    """

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: Optional[float] = 1e-5,
                 elementwise_affine: bool = False, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(
            normalized_shape)
        super().__init__(shape, eps, elementwise_affine, device=device, dtype=dtype)
        gain: Optional[Tensor] = self.__dict__["_parameters"].get("weight")
        if gain is not None:
            self.weight = Parameter(gain.data, "norm")

    def forward(self, input: Tensor) -> Tensor:
        return U.rms_norm(input, self.normalized_shape, self.weight, self.eps)


