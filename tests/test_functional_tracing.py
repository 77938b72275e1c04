"""U under torch.compile and under no_grad: one graph for the whole GPT, constants always there."""
from __future__ import annotations

import pytest
import torch

import ipu_unit_scaling.functional as U
from ipu_unit_scaling import TransformerDecoder


def test_gelu_constants_do_not_depend_on_the_grad_mode():
    compute = U._gelu_stds.__wrapped__  # bypass the cache: recompute in each mode
    reference = compute("tanh")
    with torch.no_grad():
        assert compute("tanh") == reference
    with torch.inference_mode():
        assert compute("tanh") == reference


def test_gpt_training_forward_compiles_to_one_graph():
    explain = getattr(getattr(torch, "_dynamo", None), "explain", None)
    if explain is None:
        pytest.skip("torch._dynamo.explain is not available in this torch")
    torch.manual_seed(0)
    model = TransformerDecoder(vocab_size=16, hidden_size=8, depth=1, heads=2, seq_len=4)
    ids = torch.randint(16, (2, 4))
    result = explain(model)(ids, ids)
    assert result.graph_break_count == 0, [str(r.reason)[:200] for r in result.break_reasons]
