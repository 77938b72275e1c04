"""Masked-LM batches: BERT's masking, padding to random lengths, reproducible from a seed."""
from __future__ import annotations

import pytest
import torch

from ipu_unit_scaling.loop.masked_lm import mask_tokens, masked_batch

SEQ_LEN, MIN_LEN = 24, 8


def test_masking_follows_bert():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4000, 32), generator=gen)
    real = torch.arange(32)[None, :] < torch.randint(1, 33, (4000, 1), generator=gen)
    inputs, labels = mask_tokens(ids, real, mask_id=51, vocab=50, mask_prob=0.15, generator=gen)
    targets = labels != -100
    assert not (targets & ~real).any()  # padding is never a target
    assert targets.any(dim=1).all()  # every sequence has one
    assert torch.equal(labels[targets], ids[targets])
    # 15% of each row's L real tokens, plus the forced one where none was drawn (0.85**L).
    lengths = real.sum(dim=1).double()
    expected = (0.15 * lengths + 0.85**lengths).sum().item()
    assert targets.sum().item() == pytest.approx(expected, rel=0.02)
    masked = (inputs == 51) & targets
    kept = (inputs == ids) & targets
    assert abs(masked.sum().item() / targets.sum().item() - 0.8) < 0.02
    # 10% kept, plus the random replacements that drew the same token (1 in 50 of 10%).
    assert abs(kept.sum().item() / targets.sum().item() - 0.102) < 0.015
    assert torch.equal(inputs[~targets], ids[~targets])


def test_batches_are_padded_to_random_lengths_and_reproducible():
    tokens = torch.arange(1000) % 40
    first, second = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(3):
        a = masked_batch(tokens, 40, 8, SEQ_LEN, MIN_LEN, 0.15, first)
        b = masked_batch(tokens, 40, 8, SEQ_LEN, MIN_LEN, 0.15, second)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    inputs, labels = a
    pads = inputs == 40  # the padding id is the vocabulary's size
    lengths = (~pads).sum(dim=1)
    assert ((lengths >= MIN_LEN) & (lengths <= SEQ_LEN)).all()
    assert (labels[pads] == -100).all()
    # Padding is a suffix.
    assert torch.equal(pads, torch.arange(SEQ_LEN)[None, :] >= lengths[:, None])
