"""The example GPT: one definition, built unit-scaled or from plain torch modules."""
from __future__ import annotations

from dataclasses import dataclass

from .modules import TORCH_OPS, UNIT_OPS, TransformerDecoder


@dataclass
class GPTConfig:
    """Shape of a character-level GPT; defaults are the default run (``configs/default.yaml``).

    It is also the ``model`` section of a run config (``ipu_unit_scaling.config``), where
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


def build_gpt(config: GPTConfig) -> TransformerDecoder:
    """Build the GPT: unit-scaled parts, or plain torch parts at torch's default init."""
    return TransformerDecoder(
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
