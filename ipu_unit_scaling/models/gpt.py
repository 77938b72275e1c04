"""The example GPT: one definition, built unit-scaled, in u-μP, or from plain torch modules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..modules.gpt_blocks import GPT, TORCH_OPS, UNIT_OPS
from ..parametrization.umup import UmupHyperparameters, umup_decoder
from ..parametrization.umup_rules import UmupRules

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
