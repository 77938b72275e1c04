"""unit_scaling's u-μP transformer, on this package's ops: `uu.MHSA`, `uu.MLP`,
`uu.TransformerLayer`, `uu.TransformerDecoder`, and the depth-aware containers
`uu.DepthSequential` and `uu.DepthModuleList`.

Same constructors, attribute names and u-μP semantics as unit-scaling 0.3.5, so models written
for it run unchanged:

- `DepthSequential` / `DepthModuleList` record their length on every parameter inside them
  (`mup_scaling_depth`), which u-μP's optimizers turn into a learning rate times
  `depth**-0.5` (depth-μP);
- `TransformerDecoder` is a pre-norm decoder (RMSNorm, SwiGLU MLP, causal attention with
  logits `mult * q.k / head_dim`), its residual weights from
  `core.functional.transformer_residual_scaling_rule`, its readout `LinearReadout`.

One difference, nearer unit scale: attention dropout follows `train()` / `eval()` here (as in
torch), where unit_scaling applies it in both.

For this package's own GPT, built from an `Ops` table for unit-scaled and plain comparisons,
see `ipu_unit_scaling.models.gpt.GPT`.
"""
from __future__ import annotations

from typing import Any, Iterable

from torch import Tensor, nn

from .. import ops as U
from ..ops.op_helpers import ResidualScalingFn, transformer_residual_scaling_rule
from .layers import Embedding, Linear, LinearReadout, RMSNorm
from .mup_parameter import has_parameter_data

__all__ = [
    "MLP", "MHSA", "TransformerLayer", "DepthModuleList", "DepthSequential", "TransformerStack",
    "TransformerDecoder",
]


class MLP(nn.Module):
    """Unit-scaled SwiGLU MLP: `linear_2(silu_glu(linear_1(x), linear_gate(x)))`.

    The three linears are unconstrained: `linear_1` and `linear_gate` read the input and
    `linear_2` writes the output, so their forward and backward scales mirror each other.
    """

    def __init__(self, hidden_size: int, expansion_factor: int = 4) -> None:
        super().__init__()
        intermediate_size = hidden_size * expansion_factor
        self.linear_1 = Linear(hidden_size, intermediate_size, constraint=None)
        self.linear_gate = Linear(hidden_size, intermediate_size, constraint=None)
        self.linear_2 = Linear(intermediate_size, hidden_size, constraint=None)

    def forward(self, input: Tensor) -> Tensor:
        z = U.silu_glu(self.linear_1(input), self.linear_gate(input))
        return self.linear_2(z)  # type: ignore[no-any-return]


class MHSA(nn.Module):
    """Unit-scaled multi-head self-attention: a fused query-key-value linear (features laid
    out as (3, heads, head_dim)), `U.scaled_dot_product_attention` with logits
    `mult * q.k / head_dim`, and an output linear."""

    def __init__(self, hidden_size: int, heads: int, is_causal: bool, dropout_p: float = 0.0,
                 mult: float = 1.0) -> None:
        super().__init__()
        if hidden_size % heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by heads={heads}")
        self.heads = heads
        self.dropout_p = dropout_p
        self.is_causal = is_causal
        self.mult = mult
        self.linear_qkv = Linear(hidden_size, 3 * hidden_size)
        self.linear_o = Linear(hidden_size, hidden_size)

    def forward(self, input: Tensor) -> Tensor:
        batch, seq, hidden = input.shape
        qkv = self.linear_qkv(input).view(batch, seq, 3, self.heads, hidden // self.heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = U.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.is_causal, mult=self.mult)
        return self.linear_o(out.transpose(1, 2).reshape(batch, seq, hidden))  # type: ignore


class TransformerLayer(nn.Module):
    """Unit-scaled pre-norm transformer layer: RMSNorm, `MHSA`, RMSNorm, `MLP`, each branch
    joined by `U.residual_split` / `U.residual_add` with its own tau (`mhsa_tau`,
    `mlp_tau`), dropout `dropout_p` after each branch and in attention."""

    def __init__(self, hidden_size: int, heads: int, mhsa_tau: float, mlp_tau: float,
                 is_causal: bool, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        self.mhsa_tau = mhsa_tau
        self.mlp_tau = mlp_tau
        self.mhsa_norm = RMSNorm(hidden_size)
        self.mhsa = MHSA(hidden_size, heads, is_causal=is_causal, dropout_p=dropout_p)
        self.mlp_norm = RMSNorm(hidden_size)
        self.mlp = MLP(hidden_size)

    def forward(self, input: Tensor) -> Tensor:
        branch, skip = U.residual_split(input, self.mhsa_tau)
        branch = U.dropout(self.mhsa(self.mhsa_norm(branch)), self.dropout_p, self.training)
        hidden = U.residual_add(branch, skip, self.mhsa_tau)
        branch, skip = U.residual_split(hidden, self.mlp_tau)
        branch = U.dropout(self.mlp(self.mlp_norm(branch)), self.dropout_p, self.training)
        return U.residual_add(branch, skip, self.mlp_tau)


def _set_depth(container: nn.Module, depth: int) -> None:
    for name, parameter in container.named_parameters():
        if not has_parameter_data(parameter):
            raise ValueError(f"parameter {name!r} is not a u-μP parameter (no mup_type): "
                             "build the stack from ipu_unit_scaling modules")
        if parameter.mup_scaling_depth is not None:  # type: ignore[attr-defined]
            raise ValueError(f"parameter {name!r} already belongs to a stack of depth "
                             f"{parameter.mup_scaling_depth}")  # type: ignore[attr-defined]
        parameter.mup_scaling_depth = depth  # type: ignore[attr-defined]


class DepthModuleList(nn.ModuleList):
    """`nn.ModuleList` of residual blocks: each parameter inside gets `mup_scaling_depth`, the
    list's length when built (later changes to the list are not tracked)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        super().__init__(modules)
        _set_depth(self, len(self))


class DepthSequential(nn.Sequential):
    """`nn.Sequential` of residual blocks: each parameter inside gets `mup_scaling_depth`, the
    number of blocks when built (later changes are not tracked)."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__(*modules)
        _set_depth(self, len(self))


_DEFAULT_RESIDUAL_SCALING = transformer_residual_scaling_rule()


class TransformerStack(DepthSequential):
    """`layers` `TransformerLayer`s whose taus come from `residual_scaling(index, 2 * layers)`
    (attention branches at even indices); other arguments as `TransformerLayer`'s."""

    def __init__(self, layers: int,
                 residual_scaling: ResidualScalingFn = _DEFAULT_RESIDUAL_SCALING,
                 **kwargs: Any) -> None:
        super().__init__(*(
            TransformerLayer(**kwargs, mhsa_tau=residual_scaling(2 * i, 2 * layers),
                             mlp_tau=residual_scaling(2 * i + 1, 2 * layers))
            for i in range(layers)
        ))


class TransformerDecoder(nn.Sequential):
    """unit_scaling's u-μP decoder: embedding, a causal `TransformerStack`, RMSNorm and a
    `LinearReadout` to logits. `model(input_ids)` gives the logits; `model.loss(input_ids)` the
    next-token cross-entropy. Like unit_scaling's, it has no position embedding.
    """

    def __init__(self, hidden_size: int, vocab_size: int, layers: int, heads: int,
                 dropout_p: float = 0.0,
                 residual_scaling: ResidualScalingFn = _DEFAULT_RESIDUAL_SCALING) -> None:
        super().__init__()
        self.embedding = Embedding(vocab_size, hidden_size)
        self.layers = TransformerStack(layers=layers, hidden_size=hidden_size, heads=heads,
                                       is_causal=True, dropout_p=dropout_p,
                                       residual_scaling=residual_scaling)
        self.final_norm = RMSNorm(hidden_size)
        self.projection = LinearReadout(hidden_size, vocab_size)

    def loss(self, input_ids: Tensor) -> Tensor:
        """Mean cross-entropy of each token's logits against the next token."""
        logits = self(input_ids).float()
        return U.cross_entropy(logits[..., :-1, :].flatten(end_dim=-2),
                               input_ids[..., 1:].flatten())
