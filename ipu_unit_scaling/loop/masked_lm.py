"""The masked-LM task's pieces that the training loop uses: BERT's masking, masked batches,
the encoder a run config describes, and its evaluation (loss and accuracy over the targets).

The comparison of precisions that trains it (``compare --model bert``) is :mod:`..apps.mlm`.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch
from torch import Tensor, nn

from .. import modules as uu
from ..fp8 import NonFiniteAmaxError
from ..models.encoder import BertStyleEncoder
from ..training.run_config import Config

__all__ = ["ENCODER_OPS", "mask_tokens", "masked_batch", "encoder_from_config", "evaluate"]

# The encoder's model kinds (config_names.MODEL_KINDS less u-μP, which it has no form of).
ENCODER_OPS = {"plain": uu.TORCH_OPS, "unit": uu.UNIT_OPS}


def mask_tokens(ids: Tensor, real: Tensor, mask_id: int, vocab: int, mask_prob: float,
                generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """BERT's masking of the real (unpadded) positions: (inputs, labels), labels -100 off target.

    Each real token is a target with probability `mask_prob`, and every sequence gets at least
    one; a target's input becomes `mask_id` (80%), a random token below `vocab` (10%) or stays
    (10%).
    """
    chosen = (torch.rand(ids.shape, generator=generator) < mask_prob) & real
    first = real.float().argmax(dim=1)  # a real position of each row, for rows without a target
    none = ~chosen.any(dim=1)
    chosen[none, first[none]] = True
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    kind = torch.rand(ids.shape, generator=generator)
    random_tokens = torch.randint(0, vocab, ids.shape, generator=generator)
    inputs = torch.where(chosen & (kind < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_tokens, inputs)
    return inputs, labels


def masked_batch(tokens: Tensor, vocab: int, rows: int, seq_len: int, min_len: int,
                 mask_prob: float, generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """``rows`` padded, masked sequences of ``tokens`` (ids below ``vocab``): windows at random
    starts cut to a random length in [``min_len``, ``seq_len``], padded with ``vocab``, masked
    by :func:`mask_tokens` with mask token ``vocab + 1``."""
    starts = torch.randint(0, len(tokens) - seq_len, (rows,), generator=generator)
    ids = tokens[starts[:, None] + torch.arange(seq_len)]
    lengths = torch.randint(min_len, seq_len + 1, (rows,), generator=generator)
    real = torch.arange(seq_len)[None, :] < lengths[:, None]
    ids = torch.where(real, ids, torch.full_like(ids, vocab))
    return mask_tokens(ids, real, vocab + 1, vocab, mask_prob, generator)


def encoder_from_config(config: Config) -> nn.Module:
    """The encoder ``config.model`` describes (plain or unit-scaled by ``model.unit_scaled``;
    the vocabulary ``model.vocab_size`` characters plus padding and mask), in
    ``config.precision``."""
    from ..training.precision import model_kind, simulate_fp16

    shape = config.model
    model: nn.Module = BertStyleEncoder(
        shape.vocab_size + 2, shape.hidden_size, shape.depth, shape.heads, shape.seq_len,
        pad_id=shape.vocab_size, mlp_expansion=shape.mlp_expansion, dropout_p=shape.dropout,
        attn_tau=shape.attn_tau, mlp_tau=shape.mlp_tau, ops=ENCODER_OPS[model_kind(config.model)],
    )
    if config.precision.dtype == "fp8":
        from ..transforms import simulate_fp8

        model = simulate_fp8(model, config.precision.fp8)
    elif config.precision.dtype == "fp16":
        model = simulate_fp16(model)
    return model


def evaluate(model: nn.Module, batches: Sequence[Tuple[Tensor, Tensor]]) -> Tuple[float, float]:
    """(MLM loss per target, accuracy over targets) on `batches`."""
    was_training = model.training
    model.eval()
    total_loss, correct, targets = 0.0, 0, 0
    try:
        with torch.no_grad():
            for inputs, labels in batches:
                loss, logits = model(inputs, labels, return_logits=True)
                counted = labels != -100
                total_loss += float(loss) * int(counted.sum())
                correct += int((logits.argmax(-1) == labels)[counted].sum())
                targets += int(counted.sum())
    except NonFiniteAmaxError:  # an FP8 cast that meets a non-finite value refuses it
        return math.nan, math.nan
    finally:
        model.train(was_training)
    return total_loss / targets, correct / targets
