"""A decoder written as unit-scaling 0.3.5's documentation writes one, with its public API only
(imported from this package), trained by ``ipu-unit-scaling train`` as a given model::

    ipu-unit-scaling train --config examples/library_decoder.yaml

or, with any config, ``--set model.factory=examples.library_decoder:build`` (from the
repository root, where ``examples`` imports).
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

import ipu_unit_scaling as uu


class LibraryDecoder(nn.Module):
    """u-μP decoder: embedding, causal transformer layers with u-μP's residual rule, RMSNorm and
    the readout. Like the library's ``TransformerDecoder`` it has no position embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, depth: int, heads: int,
                 dropout_p: float = 0.0, residual_mult: float = 1.0,
                 residual_attn_ratio: float = 1.0) -> None:
        super().__init__()
        self.embedding = uu.Embedding(vocab_size, hidden_size)
        rule = uu.transformer_residual_scaling_rule(residual_mult, residual_attn_ratio)
        self.layers = uu.DepthSequential(*(
            uu.TransformerLayer(hidden_size, heads, mhsa_tau=rule(2 * i, 2 * depth),
                                mlp_tau=rule(2 * i + 1, 2 * depth), is_causal=True,
                                dropout_p=dropout_p)
            for i in range(depth)))
        self.final_norm = uu.RMSNorm(hidden_size)
        self.projection = uu.LinearReadout(hidden_size, vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``[batch, seq, vocab_size]`` of ids ``[batch, seq]``."""
        return self.projection(self.final_norm(self.layers(self.embedding(input_ids))))


def build(settings: Any) -> nn.Module:
    """The decoder of the run's ``model`` settings (its vocabulary is the corpus's)."""
    return LibraryDecoder(settings.vocab_size, settings.hidden_size, settings.depth,
                          settings.heads, settings.dropout, settings.residual_mult,
                          settings.residual_attn_ratio)
