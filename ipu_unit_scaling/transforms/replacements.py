"""What `unit_scale` swaps in: unit-scaled modules for torch modules, U ops for torch functions.

Module converters build a fresh, unit-initialised module of the same shape (the converted model
is trained from scratch; old weights are meaningless under the new scales). Function adapters
take exactly the arguments of the torch function they replace, so a graph node keeps its
arguments and only changes its target.
"""
from __future__ import annotations

import math
import operator
import sys
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import modules as uu
from .. import ops as U
from ..ops import loss_ops, unit_ops

# The constraint of the ops and modules `unit_scale` puts in: the paper's geometric mean, with
# which converted models were measured (the ops' own default is unit_scaling's
# "to_output_scale").
CONSTRAINT = "gmean"
# GELU's, apart: the output scale in both passes (unit-scaling's default, and this package's u-muP
# GPT's), so the activation's forward output is unit. On unit-scaling's nanoGPT demo the
# converted FP8 model ended lower with it than with gmean on each of 8 seeds
# (docs/results/nanogpt-demo).
GELU_CONSTRAINT = "to_output_scale"

__all__ = [
    "UnitMultiheadAttention",
    "UnitAttention",
    "UnitConv1D",
    "module_converters",
    "FUNCTION_ADAPTERS",
    "ATTENTION_TARGETS",
    "SHAPE_TARGETS",
    "SILU_TARGETS",
    "MUL_TARGETS",
    "is_silu_module",
    "scale_preserving_functions",
]

# Builds the replacement from the original module (typed loosely: each takes its own class).
# None: this instance cannot be converted (it is kept, and reported).
ModuleConverter = Callable[[Any], Optional[nn.Module]]


# ---------------------------------------------------------------- modules


class UnitMultiheadAttention(nn.Module):
    """Unit-scaled stand-in for `nn.MultiheadAttention` (self- or cross-attention).

    Takes the same call arguments and returns `(output, None)`: attention weights are never
    materialised. Masks follow torch's MHA convention (boolean True = may not attend, or an
    additive float mask of 0 and -inf) and are turned into the boolean mask the unit-scaled
    attention needs to know how many keys each query sees.
    """

    def __init__(self, source: nn.MultiheadAttention) -> None:
        super().__init__()
        if source.kdim != source.embed_dim or source.vdim != source.embed_dim:
            raise ValueError("MultiheadAttention with kdim/vdim != embed_dim is not supported")
        embed_dim = source.embed_dim
        bias = source.in_proj_bias is not None
        self.embed_dim = embed_dim
        self.num_heads = source.num_heads
        self.batch_first = source.batch_first
        self.dropout = source.dropout
        self.q_proj = uu.Linear(embed_dim, embed_dim, bias=bias, constraint=CONSTRAINT)
        self.k_proj = uu.Linear(embed_dim, embed_dim, bias=bias, constraint=CONSTRAINT)
        self.v_proj = uu.Linear(embed_dim, embed_dim, bias=bias, constraint=CONSTRAINT)
        self.out_proj = uu.Linear(embed_dim, embed_dim, bias=source.out_proj.bias is not None,
                                  constraint=CONSTRAINT)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, None]:
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, target_len, _ = query.shape
        source_len = key.shape[1]
        head_dim = self.embed_dim // self.num_heads

        def heads(x: Tensor, length: int) -> Tensor:
            return x.view(batch, length, self.num_heads, head_dim).transpose(1, 2)

        q = heads(self.q_proj(query), target_len)
        k = heads(self.k_proj(key), source_len)
        v = heads(self.v_proj(value), source_len)
        allowed = _allowed_mask(attn_mask, key_padding_mask, batch, self.num_heads)
        out = U.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and allowed is None, scale=head_dim**-0.5,
        )
        out = self.out_proj(out.transpose(1, 2).reshape(batch, target_len, self.embed_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None


def _as_allowed(mask: Tensor) -> Tensor:
    """torch MHA mask (True / -inf = blocked) to an SDPA mask (True = may attend)."""
    if mask.dtype == torch.bool:
        return ~mask
    blocked = torch.isneginf(mask)
    if not torch.all(blocked | (mask == 0)):
        raise ValueError("the unit-scaled attention takes float masks of 0 and -inf only")
    return ~blocked


class UnitAttention(nn.Module):
    """`U.scaled_dot_product_attention` whose dropout follows `train()` / `eval()`.

    A traced call fixes `dropout_p` to the value it had when traced (in training, usually);
    as a module, attention dropout is off in eval mode, as in the original model.
    """

    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.dropout_p = dropout_p

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
        is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
    ) -> Tensor:
        return unit_scaled_dot_product_attention(
            query, key, value, attn_mask, self.dropout_p if self.training else 0.0, is_causal,
            scale, enable_gqa,
        )


def _allowed_mask(
    attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], batch: int, heads: int
) -> Optional[Tensor]:
    allowed: Optional[Tensor] = None
    if attn_mask is not None:
        allowed = _as_allowed(attn_mask)
        if allowed.dim() == 3:  # (batch * heads, L, S)
            allowed = allowed.view(batch, heads, *allowed.shape[1:])
    if key_padding_mask is not None:
        keys = _as_allowed(key_padding_mask)[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


class UnitConv1D(nn.Module):
    """Unit-scaled stand-in for the `Conv1D` of Hugging Face GPT-2 (a linear, weight transposed)."""

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        weight = source.weight
        assert isinstance(weight, Tensor)
        in_features, out_features = weight.shape
        self.nf = out_features
        self.weight = nn.Parameter(torch.randn(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, input: Tensor) -> Tensor:
        return U.linear(input, self.weight.t(), self.bias, CONSTRAINT)


def _linear(m: nn.Linear) -> nn.Module:
    return uu.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                     constraint=CONSTRAINT)


def _layer_norm(m: nn.LayerNorm) -> nn.Module:
    new = uu.LayerNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.elementwise_affine)
    if m.elementwise_affine and m.bias is None:
        new.register_parameter("bias", None)
    return new


def _embedding(m: nn.Embedding) -> nn.Module:
    return uu.Embedding(
        m.num_embeddings, m.embedding_dim, m.padding_idx, m.max_norm, m.norm_type,
        m.scale_grad_by_freq, m.sparse,
    )


def _cross_entropy_loss(m: nn.CrossEntropyLoss) -> Optional[nn.Module]:
    """`uu.CrossEntropyLoss`, keeping a label smoothing (with the one-hot rule's scale); None
    (not converted) with class weights."""
    if m.weight is not None:
        return None
    new = uu.CrossEntropyLoss(ignore_index=m.ignore_index, reduction=m.reduction)
    new.label_smoothing = m.label_smoothing
    return new


def _rms_norm(m: nn.Module) -> Optional[nn.Module]:
    """`nn.RMSNorm`, or a model's own RMSNorm class (Llama's and its kin's): a 1-D `weight`
    and an epsilon named `eps` or `variance_epsilon`. None (not converted) for another shape."""
    weight = getattr(m, "weight", None)
    eps: Optional[float] = getattr(m, "eps", getattr(m, "variance_epsilon", None))
    if isinstance(weight, Tensor) and weight.dim() == 1:
        return uu.RMSNorm(weight.shape[0], eps=eps, elementwise_affine=True)
    if isinstance(m, getattr(nn, "RMSNorm", ())) and weight is None:
        shape: Tuple[int, ...] = tuple(m.normalized_shape)  # type: ignore[arg-type]
        return uu.RMSNorm(shape, eps=eps, elementwise_affine=False)
    return None


def module_converters() -> Dict[type, ModuleConverter]:
    """Built-in module conversions, keyed by the exact class they convert."""
    converters: Dict[type, ModuleConverter] = {
        nn.Linear: _linear,
        nn.LayerNorm: _layer_norm,
        nn.Embedding: _embedding,
        nn.GELU: lambda m: uu.GELU(approximate=m.approximate, constraint=GELU_CONSTRAINT),
        nn.ReLU: lambda m: uu.ReLU(constraint=CONSTRAINT),
        nn.Softmax: lambda m: uu.Softmax(m.dim if m.dim is not None else -1,
                                         constraint=CONSTRAINT),
        nn.Dropout: lambda m: uu.Dropout(m.p),
        nn.CrossEntropyLoss: _cross_entropy_loss,
        nn.MultiheadAttention: UnitMultiheadAttention,
        nn.SiLU: lambda m: uu.SiLU(constraint=CONSTRAINT),
    }
    if hasattr(nn, "RMSNorm"):  # torch >= 2.4
        converters[nn.RMSNorm] = _rms_norm
    converters.update(_transformers_converters())
    return converters


def _transformers_modeling_modules() -> List[Any]:
    """The `transformers.models.*.modeling_*` modules imported so far (a model's own module is
    imported with the model); importing transformers itself takes seconds."""
    return [module for name, module in list(sys.modules.items())
            if name.startswith("transformers.models.") and ".modeling_" in name and module]


def _gelu_converter(approximate: str) -> ModuleConverter:
    def convert(module: nn.Module) -> nn.Module:
        return uu.GELU(approximate=approximate, constraint=GELU_CONSTRAINT)

    return convert


def _transformers_converters() -> Dict[type, ModuleConverter]:
    """Hugging Face layers with exact unit-scaled equivalents.

    Looked up only where transformers is already imported (as it is when the model is one of
    its models): importing it takes seconds.
    """
    found: Dict[type, ModuleConverter] = {}
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    activations = sys.modules.get("transformers.activations")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    if conv1d is not None:
        found[conv1d] = UnitConv1D
    # "gelu_new" is the tanh approximation written out by hand.
    for name, approximate in (("NewGELUActivation", "tanh"), ("GELUActivation", "none"),
                              ("GELUTanh", "tanh"), ("PytorchGELUTanh", "tanh")):
        cls = getattr(activations, name, None) if activations is not None else None
        if cls is not None:
            found[cls] = _gelu_converter(approximate)
    silu = getattr(activations, "SiLUActivation", None) if activations is not None else None
    if isinstance(silu, type):
        found[silu] = lambda m: uu.SiLU(constraint=CONSTRAINT)
    # Llama's RMSNorm and the copies of it in other models' files (Mistral, Qwen2, ...).
    for module in _transformers_modeling_modules():
        for name, cls in list(vars(module).items()):
            if name.endswith("RMSNorm") and isinstance(cls, type) and issubclass(cls, nn.Module):
                found[cls] = _rms_norm
    return found


def scale_preserving_functions() -> Set[Callable[..., Any]]:
    """Functions kept as they are because they preserve scale, traced as single calls.

    Rotary position embeddings (`apply_rotary_pos_emb` of Hugging Face models): each pair of
    features (x_i, x_j) of a query or key becomes (x_i cos t - x_j sin t, x_j cos t + x_i sin t),
    a rotation, so every pair keeps its squared norm exactly and the tensor its mean square;
    the gradient goes through the transposed rotation, also orthogonal, so it keeps its mean
    square too (tested on the functions themselves). Traced through, their adds would look like
    sums of independent tensors and be scaled by 1/sqrt(2), which would be wrong.
    """
    found: Set[Callable[..., Any]] = set()
    for module in _transformers_modeling_modules():
        function = vars(module).get("apply_rotary_pos_emb")
        if callable(function):
            found.add(function)
    return found


# ---------------------------------------------------------------- functions


def unit_gelu(input: Tensor, approximate: str = "none") -> Tensor:
    return U.gelu(input, approximate=approximate, constraint=GELU_CONSTRAINT)


def unit_relu(input: Tensor, inplace: bool = False) -> Tensor:
    return U.relu(input, constraint=CONSTRAINT)


def unit_softmax(
    input: Tensor, dim: Optional[int] = None, _stacklevel: int = 3,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    return U.softmax(input, -1 if dim is None else dim, dtype, CONSTRAINT)


def unit_silu(input: Tensor, inplace: bool = False) -> Tensor:
    return U.silu(input, constraint=CONSTRAINT)


def unit_silu_glu(input: Tensor, gate: Tensor) -> Tensor:
    """`input * silu(gate)` (a SiLU-gated product found in the graph): `U.silu_glu`."""
    return U.silu_glu(input, gate, constraint=CONSTRAINT)


def unit_rms_norm(
    input: Tensor, normalized_shape: Any, weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
) -> Tensor:
    return U.rms_norm(input, normalized_shape, weight, eps)


def unit_matmul(input: Tensor, other: Tensor) -> Tensor:
    return U.matmul(input, other, CONSTRAINT)


def unit_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    return U.linear(input, weight, bias, CONSTRAINT)


def unit_addmm(
    bias: Tensor, input: Tensor, weight: Tensor, *, beta: float = 1, alpha: float = 1
) -> Tensor:
    """`torch.addmm(bias, x, w)` as a unit-scaled linear of x by w (w is (in, out))."""
    if beta != 1 or alpha != 1:
        raise ValueError("unit_scale converts torch.addmm only with beta=1 and alpha=1")
    return U.linear(input, weight.t(), bias, CONSTRAINT)


def unit_layer_norm(
    input: Tensor, normalized_shape: Any, weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None, eps: float = 1e-5,
) -> Tensor:
    return U.layer_norm(input, normalized_shape, weight, bias, eps)


def unit_embedding(
    input: Tensor, weight: Tensor, padding_idx: Optional[int] = None,
    max_norm: Optional[float] = None, norm_type: float = 2.0,
    scale_grad_by_freq: bool = False, sparse: bool = False,
) -> Tensor:
    return U.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


def unit_scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    if scale is None:  # torch's default, not unit_scaling's 1/head_dim
        scale = query.shape[-1] ** -0.5
    return U.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def unit_cross_entropy(
    input: Tensor, target: Tensor, weight: Optional[Tensor] = None, size_average: Any = None,
    ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    if size_average is not None or reduce is not None:
        raise ValueError("size_average/reduce are deprecated; use reduction")
    return loss_ops.smoothed_cross_entropy(input, target, weight, ignore_index, reduction,
                                           label_smoothing)


def unit_mse_loss(
    input: Tensor, target: Tensor, size_average: Any = None, reduce: Any = None,
    reduction: str = "mean", weight: Optional[Tensor] = None,
) -> Tensor:
    if size_average is not None or reduce is not None or weight is not None:
        raise ValueError("size_average/reduce/weight are not supported; use reduction")
    return U.mse_loss(input, target, reduction=reduction)


def unit_add(input: Tensor, other: Tensor, *, alpha: float = 1) -> Tensor:
    """A sum of two independent tensors (not a residual): `U.add`."""
    return U.add(input, other, alpha=alpha)


def unit_sub(input: Tensor, other: Tensor, *, alpha: float = 1) -> Tensor:
    return U.add(input, other, alpha=-alpha)


def unit_residual_branch(input: Tensor, tau: float) -> Tensor:
    """The branch side of `U.residual_split`; the skip side is the input itself."""
    return U.residual_split(input, tau)[0]


def unit_residual_add(residual: Tensor, skip: Tensor, tau: float) -> Tensor:
    """The join of `unit_residual_branch`: the skip is the stream itself (no split output), so
    it takes its weight in both passes."""
    return unit_ops.residual_join(residual, skip, tau)


# Function targets (call_function, or call_method by name) and their unit-scaled adapters.
FUNCTION_ADAPTERS: Dict[Any, Callable[..., Tensor]] = {
    F.gelu: unit_gelu,
    "gelu": unit_gelu,
    F.relu: unit_relu,
    torch.relu: unit_relu,
    "relu": unit_relu,
    F.softmax: unit_softmax,
    torch.softmax: unit_softmax,
    "softmax": unit_softmax,
    torch.matmul: unit_matmul,
    operator.matmul: unit_matmul,
    torch.bmm: unit_matmul,
    "matmul": unit_matmul,
    "bmm": unit_matmul,
    F.linear: unit_linear,
    torch.addmm: unit_addmm,
    F.layer_norm: unit_layer_norm,
    F.embedding: unit_embedding,
    F.scaled_dot_product_attention: unit_scaled_dot_product_attention,
    F.cross_entropy: unit_cross_entropy,
    F.mse_loss: unit_mse_loss,
    F.silu: unit_silu,
    torch.nn.functional.silu: unit_silu,
    "silu": unit_silu,
}
if hasattr(F, "rms_norm"):  # torch >= 2.4
    FUNCTION_ADAPTERS[F.rms_norm] = unit_rms_norm

# SiLU in its forms: as a function, a method, or the target of a SiLU module.
SILU_TARGETS: Set[Any] = {F.silu, "silu"}
if hasattr(torch, "silu"):
    SILU_TARGETS.add(torch.silu)
MUL_TARGETS = {operator.mul, torch.mul, "mul"}


def is_silu_module(module: nn.Module) -> bool:
    """torch's, ours or Hugging Face's SiLU module."""
    return isinstance(module, nn.SiLU) or (
        type(module).__name__ == "SiLUActivation"
        and type(module).__module__.startswith("transformers.")
    )

ADD_TARGETS = {operator.add, torch.add, "add"}
SUB_TARGETS = {operator.sub, torch.sub, "sub"}
DROPOUT_TARGETS = {F.dropout, torch.dropout}

ATTENTION_TARGETS = {
    F.scaled_dot_product_attention, unit_scaled_dot_product_attention,
    F.softmax, torch.softmax, "softmax", unit_softmax,
}

# Ops that only move, view, index or retype elements: they leave a tensor's scale alone.
SHAPE_TARGETS = {
    getattr, operator.getitem, torch.flatten, torch.cat, torch.stack, torch.transpose,
    torch.permute, torch.reshape, torch.squeeze, torch.unsqueeze, torch.unbind, torch.split,
    torch.chunk, torch.narrow, torch.arange, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.ones_like, torch.zeros_like, torch.full_like, torch._assert, torch.tril, torch.triu,
    operator.floordiv, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge, operator.not_, operator.invert, operator.and_, operator.or_, len,
    "view", "reshape", "permute", "transpose", "flatten", "unflatten", "contiguous", "size",
    "dim", "unbind", "split", "chunk", "squeeze", "unsqueeze", "expand", "expand_as", "to",
    "type", "float", "half", "bfloat16", "long", "int", "bool", "view_as", "masked_fill",
    "narrow", "repeat", "t", "clone", "detach", "__getitem__", "tril", "triu", "eq", "ne",
    "numel", "new_ones", "new_zeros", "new_empty", "type_as", "element_size",
}

# Math-constant helpers are fine too (the head-size square root of an attention scale).
SHAPE_TARGETS.update({math.sqrt})
