"""One transformer architecture, two builds: the GPT and its blocks (self-attention, feed-forward,
gated MLP, the residual block) written once over an :class:`Ops` table, built unit-scaled with
:data:`UNIT_OPS` or as the plain torch model with :data:`TORCH_OPS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops as U
from ..ops import activation_ops, attention_ops, fused_blocks, rule_switch, unit_ops
from ..ops import fused_ops as fused
from ..ops.scale_constraints import SharedInputGmean
from ..ops.trace_switch import is_ipu_tracing
from .layers import Embedding, LayerNorm, Linear

__all__ = [
    "GatedMLP",
    "SelfAttention",
    "FeedForward",
    "TransformerBlock",
    "Ops",
    "UNIT_OPS",
    "TORCH_OPS",
    "gmean_linear",
    "affine_layer_norm",
    "gmean_gelu",
    "gmean_silu_glu",
    "unit_attention",
]



# ---------------------------------------------------------------- one architecture, two builds


def _plain_residual_split(input: Tensor, tau: float = 1.0) -> Tuple[Tensor, Tensor]:
    return input, input


def _plain_residual_add(residual: Tensor, skip: Tensor, tau: float = 1.0) -> Tensor:
    return residual + skip


def _plain_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                     dropout_p: float = 0.0, is_causal: bool = False,
                     scale: Optional[float] = None) -> Tensor:
    """`F.scaled_dot_product_attention`; under `ipu_tracing()` built from ops PopTorch has."""
    if scale is not None and abs(scale * query.shape[-1] ** 0.5 - 1.0) >= 1e-12:
        # torch 2.0 has no `scale` argument: fold a scale other than the default into the query.
        query = query * (scale * query.shape[-1] ** 0.5)
    if is_ipu_tracing():
        return attention_ops.explicit_attention(query, key, value, attn_mask, dropout_p, is_causal)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          dropout_p=dropout_p, is_causal=is_causal)


def observed(module: nn.Module) -> bool:
    """Whether a hook or a torch function mode could see `module`'s output (scale tracking,
    say)."""
    hooks = nn.modules.module
    modes = getattr(torch._C, "_len_torch_function_stack", None)
    return bool(module._forward_hooks or module._forward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks or (modes is not None and modes()))


def _linear_scales(layer: Linear, input: Union[Tensor, int]) -> Tuple[float, float, float]:
    """`U.linear`'s (output, grad input, grad weight) scales for `layer` on `input` (or on as
    many rows), as its eager form caches them."""
    fan_out, fan_in = layer.weight.shape
    rows = max(1, input.numel() // max(1, fan_in)) if isinstance(input, Tensor) else input
    output, grad_input, grad_weight = fused.cached_scales(
        ("linear", fan_in, fan_out, rows, layer.constraint), unit_ops.linear_scales, fan_in,
        fan_out, rows, layer.constraint)
    return output, grad_input, grad_weight


def _plain_silu_glu(input: Tensor, gate: Tensor) -> Tensor:
    return input * F.silu(gate)


@dataclass(frozen=True)
class Ops:
    """The parts a transformer block is built from: module classes and functions."""

    Linear: Callable[..., nn.Module]
    LayerNorm: Callable[..., nn.Module]
    Embedding: Callable[..., nn.Module]
    gelu: Callable[..., Tensor]
    dropout: Callable[..., Tensor]
    add: Callable[..., Tensor]
    residual_split: Callable[..., Tuple[Tensor, Tensor]]
    residual_add: Callable[..., Tensor]
    scaled_dot_product_attention: Callable[..., Tensor]
    cross_entropy: Callable[..., Tensor]
    # input * silu(gate), for gated MLPs; defaults to the unit-scaled op.
    silu_glu: Callable[..., Tensor] = U.silu_glu


def gmean_linear(in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> Linear:
    """`Linear` with the paper's geometric-mean constraint, as the blocks below use it."""
    return Linear(in_features, out_features, bias, device, dtype, constraint="gmean")


def affine_layer_norm(normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5,
                      device: Any = None, dtype: Optional[torch.dtype] = None) -> LayerNorm:
    """`LayerNorm` with a gain and bias, as the blocks below use it."""
    return LayerNorm(normalized_shape, eps, elementwise_affine=True, device=device, dtype=dtype)


def gmean_gelu(input: Tensor) -> Tensor:
    """`U.gelu` with the paper's geometric-mean constraint, as the blocks below use it."""
    return U.gelu(input, constraint="gmean")


def unit_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                   dropout_p: float = 0.0, is_causal: bool = False,
                   scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """`U.scaled_dot_product_attention` with torch's signature and default logit scale,
    1/sqrt(head_dim) (the op's own default is u-μP's 1/head_dim)."""
    return U.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal,
        scale=query.shape[-1] ** -0.5 if scale is None else scale, enable_gqa=enable_gqa)


def gmean_silu_glu(input: Tensor, gate: Tensor) -> Tensor:
    """`U.silu_glu` with the geometric-mean constraint, as `GatedMLP` uses it."""
    return U.silu_glu(input, gate, constraint="gmean")


# The blocks below were measured and recorded with the paper's geometric-mean constraint on
# their linears and activations; the ops' own default is unit_scaling's "to_output_scale".
UNIT_OPS = Ops(
    Linear=gmean_linear,
    LayerNorm=affine_layer_norm,
    Embedding=Embedding,
    gelu=gmean_gelu,
    dropout=U.dropout,
    add=U.add,
    residual_split=U.residual_split,
    residual_add=U.residual_add,
    scaled_dot_product_attention=unit_attention,
    cross_entropy=U.cross_entropy,
    silu_glu=gmean_silu_glu,
)

TORCH_OPS = Ops(
    Linear=nn.Linear,
    LayerNorm=nn.LayerNorm,
    Embedding=nn.Embedding,
    gelu=F.gelu,
    dropout=F.dropout,
    add=torch.add,
    residual_split=_plain_residual_split,
    residual_add=_plain_residual_add,
    scaled_dot_product_attention=_plain_attention,
    cross_entropy=F.cross_entropy,
    silu_glu=_plain_silu_glu,
)


def layer_norm_module(ops: Ops, hidden_size: int, bias: bool) -> nn.Module:
    """`ops.LayerNorm`, without a bias if asked (torch 2.0's LayerNorm has no `bias` argument)."""
    norm = ops.LayerNorm(hidden_size)
    if not bias:
        norm.register_parameter("bias", None)
    return norm


class SelfAttention(nn.Module):
    """Multi-head self-attention: fused QKV projection, attention, output projection.

    The attention logits are scaled by `attention_scale`, by default torch's 1/sqrt(head_dim)
    (u-μP's GPT gives 1/head_dim; `uu.MHSA` is unit_scaling's u-μP block).
    """

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        is_causal: bool = True,
        dropout_p: float = 0.0,
        bias: bool = False,
        ops: Ops = UNIT_OPS,
        attention_scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        if hidden_size % heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by heads={heads}")
        self.heads = heads
        self.is_causal = is_causal
        self.dropout_p = dropout_p
        # None: torch's 1/sqrt(head_dim); u-μP asks for 1/head_dim.
        self.attention_scale = attention_scale
        self.qkv = ops.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.proj = ops.Linear(hidden_size, hidden_size, bias=bias)
        self.attention = ops.scaled_dot_product_attention

    def forward(self, input: Tensor, attn_mask: Optional[Tensor] = None) -> Tensor:
        """`attn_mask`: boolean, True where a query may attend (e.g. `(batch, 1, 1, seq)` to
        hide padding keys); only without `is_causal`."""
        batch, seq, hidden = input.shape
        qkv = self.qkv(input)
        if (attn_mask is None and self.attention is unit_attention
                and type(self.proj) is Linear and self.proj.bias is None
                and not observed(self.proj) and not is_ipu_tracing()):
            # Unit scaling's row scale depends on the query position only, so it commutes with
            # the (bias-free) output projection. After it, the projection's input is the attention
            # output itself, which attention keeps for its backward pass anyway: no scaled
            # copy of it is held until the backward pass. Only where nothing looks at the
            # projection's own output, which is then not scaled yet.
            out, row_scale = self.attend(qkv)
            proj = cast(Linear, self.proj)
            if fused.eager_forms() and getattr(proj, "attention_projection", None) is None:
                # The projection and the row scale in one node: U.linear's eager form (same
                # scales), its output times the row scale in place.
                return fused.linear(out, proj.weight, None, *_linear_scales(proj, out),
                                    row_scale)
            return self.proj(out) * row_scale
        query, key, value = self._heads(qkv)
        dropout_p = self.dropout_p if self.training else 0.0
        scale = {} if self.attention_scale is None else {"scale": self.attention_scale}
        out = self.attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=self.is_causal, **scale)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))

    def _heads(self, qkv: Tensor) -> Tuple[Tensor, ...]:
        """(query, key, value), each (batch, heads, seq, head_dim), of a (batch, seq, 3 *
        hidden) projection."""
        batch, seq, width = qkv.shape
        head_dim = width // (3 * self.heads)
        return qkv.view(batch, seq, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def attend(self, qkv: Tensor) -> Tuple[Tensor, Union[float, Tensor]]:
        """(the unit-scaled attention output before its row scale, as (batch, seq, hidden),
        the row scale) of the QKV projection `qkv`; see `attend_heads`."""
        batch, seq, width = qkv.shape
        out, row_scale = self.attend_heads(qkv)
        return out.transpose(1, 2).reshape(batch, seq, width // 3), row_scale

    def attend_heads(self, qkv: Tensor) -> Tuple[Tensor, Union[float, Tensor]]:
        """(the unit-scaled attention output before its row scale, as (batch, heads, seq,
        head_dim), the row scale) of the QKV projection `qkv`: the unit-scaled attention
        without a mask, its row scale left for a later op to apply."""
        query, key, value = self._heads(qkv)
        return attention_ops.attention_before_row_scale(
            query, key, value, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.is_causal, scale=self.attention_scale)


class FeedForward(nn.Module):
    """Position-wise feed-forward block: Linear, GELU, Linear (`uu.MLP` is unit_scaling's
    SwiGLU block)."""

    def __init__(
        self, hidden_size: int, expansion: int = 4, bias: bool = False, ops: Ops = UNIT_OPS
    ) -> None:
        super().__init__()
        self.up = ops.Linear(hidden_size, expansion * hidden_size, bias=bias)
        self.down = ops.Linear(expansion * hidden_size, hidden_size, bias=bias)
        self.gelu = ops.gelu

    def forward(self, input: Tensor) -> Tensor:
        if self._fusable(input):
            return self._fused(input)
        return self.down(self.gelu(self.up(input)))

    def _fusable(self, input: Tensor) -> bool:
        """Whether the one-Function eager form applies: unit-scaled parts that nothing
        observes, eager mode, a non-empty input."""
        up, down = self.up, self.down
        return (self.gelu is gmean_gelu and type(up) is Linear and type(down) is Linear
                and input.dim() >= 2 and input.numel() > 0 and not observed(up)
                and not observed(down) and fused.eager_forms())

    def _fused(self, input: Tensor) -> Tensor:
        up, down = cast(Linear, self.up), cast(Linear, self.down)
        return fused_blocks.mlp(input, up.weight, up.bias, down.weight, down.bias, "none",
                                self.fused_scales(input))

    def fused_scales(self, input: Tensor) -> Tuple[float, ...]:
        """The scales of `fused_blocks.mlp` on `input`: the two linears' and GELU's."""
        up, down = cast(Linear, self.up), cast(Linear, self.down)
        rows = input.numel() // input.shape[-1]
        gelu_scales = fused.cached_scales(("gelu", "none", "gmean"),
                                          activation_ops.gelu_scales, "none", "gmean")
        return (*_linear_scales(up, rows), *gelu_scales, *_linear_scales(down, rows))


class GatedMLP(nn.Module):
    """Gated feed-forward block (SwiGLU, as in Llama): `down(up(x) * silu(gate(x)))`.

    Unit-scaled, the gate and up projections read the same input, so they share one
    grad-input scale (`constraints.SharedInputGmean`: the input gets a unit gradient, not
    sqrt(2)), gmean-tied to their output scale; that leaves each at
    (2 intermediate / hidden)**-0.25, and the product has two such factors: for Llama's 8/3
    expansion the block's output and weight gradients sit near 0.6 to 0.8 of unit.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, ops: Ops = UNIT_OPS
    ) -> None:
        super().__init__()
        self.gate = ops.Linear(hidden_size, intermediate_size, bias=bias)
        self.up = ops.Linear(hidden_size, intermediate_size, bias=bias)
        self.down = ops.Linear(intermediate_size, hidden_size, bias=bias)
        self.silu_glu = ops.silu_glu
        for projection in (self.gate, self.up):  # both read the input: see SharedInputGmean
            if isinstance(projection, Linear):
                projection.constraint = SharedInputGmean(2 * intermediate_size)

    def forward(self, input: Tensor) -> Tensor:
        return self.down(self.silu_glu(self.up(input), self.gate(input)))


class TransformerBlock(nn.Module):
    """Pre-norm transformer layer (`uu.TransformerLayer` is unit_scaling's u-μP layer).

    Each branch is joined by `residual_split` / `residual_add` with its own tau (branch-to-skip
    weight ratio): a small attention tau keeps early training close to the identity, where
    attention is least reliable.

    Layers are bias-free by default, like most current GPTs. A bias that feeds attention values
    sums gradients over positions, which causal attention correlates, so its gradient sits about
    sqrt(seq_len / 2e) above unit; `bias=True` gives GPT-2-style biases anyway.
    """

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        mlp_expansion: int = 4,
        is_causal: bool = True,
        dropout_p: float = 0.0,
        attn_tau: float = 0.2,
        mlp_tau: float = 0.5,
        bias: bool = False,
        ops: Ops = UNIT_OPS,
        attention_scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.attn_norm = layer_norm_module(ops, hidden_size, bias)
        self.attn = SelfAttention(hidden_size, heads, is_causal, dropout_p, bias, ops,
                                  attention_scale)
        self.mlp_norm = layer_norm_module(ops, hidden_size, bias)
        self.mlp = FeedForward(hidden_size, mlp_expansion, bias, ops)
        self.attn_tau = attn_tau
        self.mlp_tau = mlp_tau
        self.dropout_p = dropout_p
        self.ops = ops

    def forward(self, input: Tensor) -> Tensor:
        if self._fusable(input):
            return self._fused(input)
        ops = self.ops
        branch, skip = ops.residual_split(input, self.attn_tau)
        branch = ops.dropout(self.attn(self.attn_norm(branch)), self.dropout_p, self.training)
        hidden = ops.residual_add(branch, skip, self.attn_tau)
        branch, skip = ops.residual_split(hidden, self.mlp_tau)
        branch = ops.dropout(self.mlp(self.mlp_norm(branch)), self.dropout_p, self.training)
        return ops.residual_add(branch, skip, self.mlp_tau)

    def _fusable(self, input: Tensor) -> bool:
        """Whether the residual joins, splits and norms take their one-Function eager form:
        unit-scaled parts, norms that nothing observes, eager mode, a non-empty input."""
        ops, norms = self.ops, (self.attn_norm, self.mlp_norm)
        return (ops.residual_split is U.residual_split and ops.residual_add is U.residual_add
                and all(type(norm) is LayerNorm and norm.normalized_shape == input.shape[-1:]
                        and not observed(norm) for norm in norms)
                and input.numel() > 0 and fused.eager_forms())

    def _fused(self, input: Tensor) -> Tensor:
        branch, stream, _, _ = self._fused_unjoined(input, None)
        return U.residual_add(branch, stream, self.mlp_tau)

    def _fused_unjoined(self, input: Tensor, pending: Optional[Tuple[Tensor, float, float]],
                        weigh_branch: bool = False) -> Tuple[Tensor, Tensor, float, float]:
        """The fused block but for its last residual join: (branch, stream, branch weight,
        skip weight), the block's output being `skip weight * stream + branch weight *
        branch`. A `GPT` leaves that join to the next block's first `residual_norm` (or to the
        final norm's), which makes it anyway: one node per layer fewer. `pending` is the
        previous block's (branch, branch weight, skip weight), joined into `input` (its
        stream) first; None: `input` is the stream. `weigh_branch`: the branch may come
        already times its weight (then given as 1), where that saves a pass."""
        ops = self.ops
        attn_branch, attn_skip = unit_ops.residual_tau_weights(self.attn_tau)
        mlp_branch, mlp_skip = unit_ops.residual_tau_weights(self.mlp_tau)
        # The norms' parameter gradients sum over every row (see U.layer_norm).
        param_scale = (input.numel() // input.shape[-1]) ** -0.5
        previous, branch_weight, skip_weight = pending if pending is not None else (None, 1.0, 1.0)
        quantisers = self._two_function_form(input)
        if quantisers is not None:
            return self._two_functions(input, previous, branch_weight, skip_weight, param_scale,
                                       weigh_branch, quantisers)
        norm = cast(LayerNorm, self.attn_norm)
        normed, stream = fused_blocks.residual_norm(
            input, previous, branch_weight, skip_weight, attn_branch, attn_skip, norm.weight,
            norm.bias, norm.eps, param_scale)
        branch = ops.dropout(self.attn(normed), self.dropout_p, self.training)
        norm = cast(LayerNorm, self.mlp_norm)
        normed, stream = fused_blocks.residual_norm(
            stream, branch, attn_branch, attn_skip, mlp_branch, mlp_skip, norm.weight,
            norm.bias, norm.eps, param_scale)
        branch = ops.dropout(self.mlp(normed), self.dropout_p, self.training)
        return branch, stream, mlp_branch, mlp_skip

    def _two_function_form(self, input: Tensor
                           ) -> Optional[Tuple[Optional[fused_blocks.Quantiser], ...]]:
        """The (QKV, output projection, MLP up, MLP down) FP8 quantisers (None for a float
        linear) if the fused block runs as two Functions around torch's attention kernel
        (`fused_blocks.norm_qkv`, `fused_blocks.proj_norm_mlp`), else None. It does without
        dropout between its parts, with unit-scaled parts (float or FP8) that have no
        gradient rules of their own and that nothing observes, and under this package's
        rules (not `rules("unit-scaling")`)."""
        attn, mlp = self.attn, self.mlp
        if not (type(attn) is SelfAttention and type(mlp) is FeedForward and input.dim() == 3
                and (self.dropout_p == 0.0 or not self.training)
                and attn.attention is unit_attention and mlp.gelu is gmean_gelu
                and getattr(attn.proj, "bias", None) is None
                and not rule_switch.library_rules() and not observed(attn)
                and not observed(mlp)):
            return None
        quantisers: List[Optional[fused_blocks.Quantiser]] = []
        for layer in (attn.qkv, attn.proj, mlp.up, mlp.down):
            if observed(layer) or getattr(layer, "attention_projection", None) is not None:
                return None
            if type(layer) is Linear:
                quantisers.append(None)
                continue
            values_quantiser = getattr(layer, "values_quantiser", None)
            quantiser = None if values_quantiser is None else values_quantiser(input)
            if quantiser is None:
                return None
            quantisers.append(quantiser)
        return tuple(quantisers)

    def _two_functions(self, input: Tensor, previous: Optional[Tensor], branch_weight: float,
                       skip_weight: float, param_scale: float, weigh_branch: bool,
                       quantisers: Tuple[Optional[fused_blocks.Quantiser], ...]
                       ) -> Tuple[Tensor, Tensor, float, float]:
        """`_fused_unjoined` as `fused_blocks.norm_qkv`, the attention kernel and
        `fused_blocks.proj_norm_mlp`: the same ops, two autograd Functions for five."""
        attn, mlp = cast(SelfAttention, self.attn), cast(FeedForward, self.mlp)
        attn_branch, attn_skip = unit_ops.residual_tau_weights(self.attn_tau)
        mlp_branch, mlp_skip = unit_ops.residual_tau_weights(self.mlp_tau)
        norm = cast(LayerNorm, self.attn_norm)
        qkv_layer = cast(Linear, attn.qkv)
        qkv, stream = fused_blocks.norm_qkv(
            input, previous, branch_weight, skip_weight, attn_branch, attn_skip, norm.weight,
            norm.bias, norm.eps, param_scale, qkv_layer.weight, qkv_layer.bias,
            _linear_scales(qkv_layer, input), quantisers[0])
        heads, row_scale = attn.attend_heads(qkv)
        norm = cast(LayerNorm, self.mlp_norm)
        proj, up, down = cast(Linear, attn.proj), cast(Linear, mlp.up), cast(Linear, mlp.down)
        branch, stream = fused_blocks.proj_norm_mlp(
            heads, row_scale, proj.weight, _linear_scales(proj, input), stream,
            norm.weight, norm.bias,
            (attn_branch, attn_skip, mlp_branch, mlp_skip, norm.eps, param_scale,
             mlp_branch if weigh_branch else 1.0),
            up.weight, up.bias, down.weight, down.bias, "none", mlp.fused_scales(input),
            quantisers[1:])
        return branch, stream, 1.0 if weigh_branch else mlp_branch, mlp_skip
