"""A BERT-style encoder for masked-language-model training, unit-scaled or plain.

The shape of BERT (Devlin et al., 2019) at a size a CPU trains in a minute: token and position
embeddings with a LayerNorm, post-norm transformer layers with bidirectional attention over the
real (unpadded) tokens, and BERT's prediction head (dense, GELU, LayerNorm, decoder). Like
`uu.GPT` it is written once against an `Ops` table: `UNIT_OPS` (the default) or
`TORCH_OPS` for the plain twin at torch's default initialisation. Bias-free, as the project's
decoder: a bias on attention values is multiplied by attention's row scale (see
`U.scaled_dot_product_attention`), which puts its gradient several times above unit.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ..modules.gpt_blocks import UNIT_OPS, FeedForward, Ops, SelfAttention, layer_norm_module

__all__ = ["EncoderLayer", "BertStyleEncoder"]


class EncoderLayer(nn.Module):
    """Post-norm layer, as in BERT: `norm(x + attn(x))`, then `norm(h + mlp(h))`.

    The sums are `residual_split` / `residual_add` with their own tau, so under unit scaling
    each branch is weighted against the skip in the forward pass and still gets unit gradients.
    """

    def __init__(self, hidden_size: int, heads: int, mlp_expansion: int = 4,
                 dropout_p: float = 0.0, attn_tau: float = 0.2, mlp_tau: float = 0.5,
                 ops: Ops = UNIT_OPS) -> None:
        super().__init__()
        self.attn = SelfAttention(hidden_size, heads, is_causal=False, dropout_p=dropout_p,
                                  ops=ops)
        self.attn_norm = layer_norm_module(ops, hidden_size, bias=False)
        self.mlp = FeedForward(hidden_size, mlp_expansion, ops=ops)
        self.mlp_norm = layer_norm_module(ops, hidden_size, bias=False)
        self.attn_tau, self.mlp_tau, self.dropout_p = attn_tau, mlp_tau, dropout_p
        self.ops = ops

    def forward(self, input: Tensor, attn_mask: Optional[Tensor] = None) -> Tensor:
        ops = self.ops
        branch, skip = ops.residual_split(input, self.attn_tau)
        branch = ops.dropout(self.attn(branch, attn_mask), self.dropout_p, self.training)
        hidden = self.attn_norm(ops.residual_add(branch, skip, self.attn_tau))
        branch, skip = ops.residual_split(hidden, self.mlp_tau)
        branch = ops.dropout(self.mlp(branch), self.dropout_p, self.training)
        return self.mlp_norm(ops.residual_add(branch, skip, self.mlp_tau))


class BertStyleEncoder(nn.Module):
    """Masked-LM encoder. `forward(input_ids)` returns logits; `forward(input_ids, labels)`
    returns the mean cross-entropy over the positions whose label is not -100 (the masked
    ones). Positions holding `pad_id` are padding: no query attends to them."""

    def __init__(self, vocab_size: int, hidden_size: int, depth: int, heads: int, seq_len: int,
                 pad_id: int, mlp_expansion: int = 4, dropout_p: float = 0.0,
                 attn_tau: float = 0.2, mlp_tau: float = 0.5, ops: Ops = UNIT_OPS) -> None:
        super().__init__()
        self.seq_len, self.pad_id, self.ops, self.dropout_p = seq_len, pad_id, ops, dropout_p
        self.embedding = ops.Embedding(vocab_size, hidden_size)
        self.position_embedding = ops.Embedding(seq_len, hidden_size)
        self.embedding_norm = layer_norm_module(ops, hidden_size, bias=False)
        self.layers = nn.ModuleList(
            EncoderLayer(hidden_size, heads, mlp_expansion, dropout_p, attn_tau, mlp_tau, ops)
            for _ in range(depth)
        )
        self.head_dense = ops.Linear(hidden_size, hidden_size, bias=False)
        self.head_norm = layer_norm_module(ops, hidden_size, bias=False)
        self.decoder = ops.Linear(hidden_size, vocab_size, bias=False)

    def forward(
        self, input_ids: Tensor, labels: Optional[Tensor] = None, return_logits: bool = False
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        if input_ids.shape[-1] > self.seq_len:
            raise ValueError(f"sequence length {input_ids.shape[-1]} exceeds the model's "
                             f"seq_len={self.seq_len}")
        ops = self.ops
        # (batch, 1, 1, keys): every query may attend to every real token.
        attn_mask = (input_ids != self.pad_id)[:, None, None, :]
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        hidden = ops.add(self.embedding(input_ids), self.position_embedding(positions))
        hidden = ops.dropout(self.embedding_norm(hidden), self.dropout_p, self.training)
        for layer in self.layers:
            hidden = layer(hidden, attn_mask)
        hidden = self.head_norm(ops.gelu(self.head_dense(hidden)))
        logits = self.decoder(hidden)
        if labels is None:
            return logits
        loss = ops.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
        return (loss, logits) if return_logits else loss
