"""The example GPT: one definition, built unit-scaled, in u-μP, or from plain torch modules."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union, cast

import torch
from torch import Tensor, nn

from .. import ops as U
from ..modules.gpt_blocks import (
    TORCH_OPS,
    UNIT_OPS,
    Ops,
    TransformerBlock,
    layer_norm_module,
    observed,
)
from ..modules.layers import Embedding, LayerNorm, Linear
from ..ops import fused_blocks
from ..ops import fused_ops as fused
from ..ops.scaling_primitive import scale_fwd
from ..parametrization.umup import (
    ScaledGELU,
    UmupHyperparameters,
    attention_logit_scale,
    logit_scale,
    residual_taus,
)
from ..parametrization.umup_rules import UmupRules, attention_op, hidden_linear


class GPT(nn.Module):
    """Decoder-only transformer language model, unit-scaled by default
    (`uu.TransformerDecoder` is unit_scaling's u-μP decoder).

    `forward(input_ids)` returns logits; `forward(input_ids, labels)` returns the mean
    cross-entropy loss, and `(loss, logits)` with `return_logits=True`.

    Other parametrizations set the rest: `taus` gives each layer its own (attention tau, MLP
    tau) instead of `attn_tau` and `mlp_tau`; `attention_scale` replaces attention's
    1/sqrt(head_dim); `head` replaces the readout linear; `logit_scale` multiplies the logits in
    the forward pass only (see `ipu_unit_scaling.parametrization.umup`, which uses all four).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        depth: int,
        heads: int,
        seq_len: int,
        mlp_expansion: int = 4,
        dropout_p: float = 0.0,
        attn_tau: float = 0.2,
        mlp_tau: float = 0.5,
        bias: bool = False,
        ops: Ops = UNIT_OPS,
        taus: Optional[Sequence[Tuple[float, float]]] = None,
        attention_scale: Optional[float] = None,
        head: Optional[nn.Module] = None,
        logit_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if taus is not None and len(taus) != depth:
            raise ValueError(f"taus has {len(taus)} entries for depth={depth}")
        layer_taus = list(taus) if taus is not None else [(attn_tau, mlp_tau)] * depth
        self.seq_len = seq_len
        self.ops = ops
        self.dropout_p = dropout_p
        self.logit_scale = logit_scale
        self.embedding = ops.Embedding(vocab_size, hidden_size)
        self.position_embedding = ops.Embedding(seq_len, hidden_size)
        self.layers = nn.ModuleList(
            TransformerBlock(
                hidden_size, heads, mlp_expansion, True, dropout_p, layer_attn_tau,
                layer_mlp_tau, bias, ops, attention_scale,
            )
            for layer_attn_tau, layer_mlp_tau in layer_taus
        )
        self.final_norm = layer_norm_module(ops, hidden_size, bias)
        self.head = head if head is not None else ops.Linear(hidden_size, vocab_size, bias=False)

    def embed(self, input_ids: Tensor) -> Tensor:
        if self._fusable_embed(input_ids):
            hidden = self._fused_embed(input_ids)
        else:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
            hidden = self.ops.add(self.embedding(input_ids), self.position_embedding(positions))
        return self.ops.dropout(hidden, self.dropout_p, self.training)

    def _fusable_embed(self, input_ids: Tensor) -> bool:
        """Whether the lookups and their sum take one Function: unit-scaled embeddings that
        nothing observes, without options, (batch, seq) ids, eager mode."""
        tables = (self.embedding, self.position_embedding)
        return (self.ops.add is U.add and input_ids.dim() == 2 and input_ids.numel() > 0
                and all(type(table) is Embedding and table.padding_idx is None
                        and table.max_norm is None and not table.scale_grad_by_freq
                        and not table.sparse and not observed(table) for table in tables)
                and fused.eager_forms())

    def _fused_embed(self, input_ids: Tensor) -> Tensor:
        # The scales of U.embedding for each lookup and of U.add's sum (constraint
        # to_output_scale, the position embedding broadcast over the batch).
        batch, seq = input_ids.shape
        tokens = cast(Embedding, self.embedding)
        positions = cast(Embedding, self.position_embedding)
        output_scale = 0.5**0.5
        token_scale = output_scale * (tokens.num_embeddings / input_ids.numel()) ** 0.5
        position_scale = output_scale * batch**-0.5 * (positions.num_embeddings / seq) ** 0.5
        return fused_blocks.embed(input_ids, tokens.weight, positions.weight, output_scale,
                                  token_scale, position_scale)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return self.ops.cross_entropy(logits.flatten(0, -2), labels.flatten())

    def _fusable_stack(self, hidden: Tensor) -> bool:
        """Whether each layer's last residual join moves into the next layer's first norm
        (the final norm's for the last layer): layers that take their fused form and that
        nothing observes, and an unobserved unit-scaled final norm."""
        norm = self.final_norm
        return (len(self.layers) > 0 and type(norm) is LayerNorm
                and norm.normalized_shape == hidden.shape[-1:] and not observed(norm)
                and all(type(layer) is TransformerBlock and not observed(layer)
                        and layer._fusable(hidden) for layer in self.layers))

    def _fused_stack(self, hidden: Tensor) -> Tensor:
        """The layers and the final norm, each layer's last join made by the next norm (see
        `TransformerBlock._fused_unjoined`): the same values and gradients as layer by layer."""
        pending: Optional[Tuple[Tensor, float, float]] = None
        for layer in self.layers:
            branch, hidden, branch_weight, skip_weight = cast(
                TransformerBlock, layer)._fused_unjoined(hidden, pending, weigh_branch=True)
            pending = (branch, branch_weight, skip_weight)
        assert pending is not None
        norm = cast(LayerNorm, self.final_norm)
        branch, branch_weight, skip_weight = pending
        normed, _ = fused_blocks.residual_norm(
            hidden, branch, branch_weight, skip_weight, 1.0, 1.0, norm.weight, norm.bias,
            norm.eps, (hidden.numel() // hidden.shape[-1]) ** -0.5)
        return normed

    def forward(
        self, input_ids: Tensor, labels: Optional[Tensor] = None, return_logits: bool = False
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        if input_ids.shape[-1] > self.seq_len:
            raise ValueError(
                f"sequence length {input_ids.shape[-1]} exceeds the model's seq_len={self.seq_len}"
            )
        hidden = self.embed(input_ids)
        if self._fusable_stack(hidden):
            normed = self._fused_stack(hidden)
        else:
            for layer in self.layers:
                hidden = layer(hidden)
            normed = self.final_norm(hidden)
        logits = self.head(normed)
        if self.logit_scale != 1.0:
            logits = scale_fwd(logits, self.logit_scale)
        if labels is None:
            return logits
        loss = self.loss(logits, labels)
        return (loss, logits) if return_logits else loss


PARAMETRIZATIONS = ("unit", "u-mup")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a character-level GPT; defaults are the default run (``configs/default.yaml``).

    It is also the ``model`` section of a run config (``ipu_unit_scaling.training.run_config``),
    where
    ``vocab_size`` is an upper bound: a run uses exactly its corpus's characters.
    """

    vocab_size: int = 256
    seq_len: int = 64
    depth: int = 2
    hidden_size: int = 128
    heads: int = 4
    mlp_expansion: int = 4
    dropout: float = 0.0
    unit_scaled: bool = True
    attn_tau: float = 0.2
    mlp_tau: float = 0.5
    bias: bool = False
    # How a unit-scaled model is parametrized: "unit" (unit scaling, attn_tau and mlp_tau) or
    # "u-mup" (ipu_unit_scaling.parametrization.umup), whose principled hyperparameters follow.
    parametrization: str = "unit"
    residual_mult: float = 1.0
    residual_attn_ratio: float = 1.0
    attn_softmax_mult: float = 1.0
    ffn_act_mult: float = 1.0
    loss_softmax_mult: float = 1.0
    # "package.module:function" building the model in place of this GPT from these settings
    # (ipu_unit_scaling.training.given_model); None trains the GPT.
    factory: Optional[str] = None
    # u-μP's rules with a choice (parametrization.umup_rules, and its measurement).
    umup_hidden_constraint: str = "gmean"
    umup_attention_scaling: str = "constant"
    umup_gelu_constraint: str = "to_output_scale"

    def umup_rules(self) -> UmupRules:
        return UmupRules(hidden_constraint=self.umup_hidden_constraint,
                         attention_scaling=self.umup_attention_scaling,
                         gelu_constraint=self.umup_gelu_constraint)

    def umup_hyperparameters(self) -> UmupHyperparameters:
        return UmupHyperparameters(
            residual_mult=self.residual_mult, residual_attn_ratio=self.residual_attn_ratio,
            attn_softmax_mult=self.attn_softmax_mult, ffn_act_mult=self.ffn_act_mult,
            loss_softmax_mult=self.loss_softmax_mult,
        )


def build_gpt(config: GPTConfig) -> GPT:
    """Build the GPT: unit-scaled parts (unit scaling or u-μP), or plain torch parts at torch's
    default init."""
    if config.parametrization not in PARAMETRIZATIONS:
        raise ValueError(f"parametrization {config.parametrization!r} is not one of "
                         f"{', '.join(PARAMETRIZATIONS)}")
    if config.parametrization == "u-mup":
        if not config.unit_scaled:
            raise ValueError("parametrization 'u-mup' needs unit_scaled=True")
        return umup_decoder(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, depth=config.depth,
            heads=config.heads, seq_len=config.seq_len, mlp_expansion=config.mlp_expansion,
            dropout_p=config.dropout, bias=config.bias,
            hyperparameters=config.umup_hyperparameters(), rules=config.umup_rules(),
        )
    return GPT(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        depth=config.depth,
        heads=config.heads,
        seq_len=config.seq_len,
        mlp_expansion=config.mlp_expansion,
        dropout_p=config.dropout,
        attn_tau=config.attn_tau,
        mlp_tau=config.mlp_tau,
        bias=config.bias,
        ops=UNIT_OPS if config.unit_scaled else TORCH_OPS,
    )


def umup_decoder(
    vocab_size: int,
    hidden_size: int,
    depth: int,
    heads: int,
    seq_len: int,
    mlp_expansion: int = 4,
    dropout_p: float = 0.0,
    bias: bool = False,
    hyperparameters: Optional[UmupHyperparameters] = None,
    rules: Optional[UmupRules] = None,
) -> GPT:
    """``uu.GPT`` in u-μP: the unit-scaled GPT with per-layer residual taus,
    1/head_dim attention, ``gelu(ffn_act_mult x)``, and a ``1/fan_in`` readout whose logits the
    loss softmax sees times ``loss_softmax_mult``. Train it with :mod:`ipu_unit_scaling.optim`,
    which reads the weight types from
    :func:`ipu_unit_scaling.parametrization.umup.weight_rules`. ``hyperparameters``: u-μP's
    (default: all 1). ``rules`` picks the hidden linears' constraint and attention's output
    scale (:mod:`ipu_unit_scaling.parametrization.umup_rules`; default: the library's)."""
    hp = hyperparameters or UmupHyperparameters()
    rules = rules or UmupRules()
    gelu = ScaledGELU(hp.ffn_act_mult, constraint=rules.gelu_constraint)
    ops = dataclasses.replace(UNIT_OPS, gelu=gelu,
                              Linear=hidden_linear(rules),
                              scaled_dot_product_attention=attention_op(rules))
    return GPT(
        vocab_size=vocab_size, hidden_size=hidden_size, depth=depth, heads=heads,
        seq_len=seq_len, mlp_expansion=mlp_expansion, dropout_p=dropout_p, bias=bias, ops=ops,
        taus=residual_taus(depth, hp.residual_mult, hp.residual_attn_ratio),
        attention_scale=attention_logit_scale(hidden_size // heads, hp.attn_softmax_mult),
        # The readout's input gradient keeps its own unit scale: a cut edge, no constraint.
        head=Linear(hidden_size, vocab_size, bias=False, constraint=None),
        logit_scale=logit_scale(hidden_size, hp.loss_softmax_mult),
    )
