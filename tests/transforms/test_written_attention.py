"""Attention written out op by op (transformers 4's form) is read as one attention call."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from ipu_unit_scaling.transforms import unit_scale_with_report
from ipu_unit_scaling.transforms.written_attention import allowed_keys, fuse_written_attention

HEADS, SEQ, HEAD_DIM = 2, 8, 16


class WrittenAttention(nn.Module):
    """matmul, scale, additive mask, softmax, matmul: as transformers 4 writes attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        batch = x.shape[0]
        q, k, v = self.qkv(x).view(batch, SEQ, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(batch, SEQ, HEADS * HEAD_DIM)
        return self.out(y)


def _additive(batch: int) -> Tensor:
    keep = torch.ones(batch, 1, 1, SEQ)
    keep[0, ..., -3:] = 0  # the first sequence's last three keys are padding
    return (1 - keep) * torch.finfo(torch.float32).min


def test_an_additive_mask_of_zero_and_the_minimum_is_the_boolean_mask() -> None:
    additive = _additive(2)
    assert torch.equal(allowed_keys(additive, None), additive == 0)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    assert torch.equal(allowed_keys(additive, causal), causal & (additive == 0))
    assert torch.equal(allowed_keys(None, causal), causal)


def test_another_additive_value_is_refused_in_one_line() -> None:
    additive = _additive(2)
    additive[1, ..., 0] = -5.0  # a soft bias: changes the softmax by an amount unknown
    with pytest.raises(ValueError, match="additive masks of 0 and the dtype's minimum only"):
        allowed_keys(additive, None)


def test_the_written_out_graph_becomes_one_attention_call_with_the_same_values() -> None:
    torch.manual_seed(0)
    model = WrittenAttention()
    graph_module = fx.symbolic_trace(model)
    x, mask = torch.randn(2, SEQ, HEADS * HEAD_DIM), _additive(2)
    expected = model(x, mask)
    for node in graph_module.graph.nodes:  # the fusion reads the head size from the shapes
        if node.op == "call_function" and node.target is torch.matmul:
            node.args[0].meta["example_shape"] = (2, HEADS, SEQ, HEAD_DIM)
    assert fuse_written_attention(graph_module, graph_module.graph, None) == 1
    graph_module.recompile()
    targets = [node.target for node in graph_module.graph.nodes if node.op == "call_function"]
    assert F.scaled_dot_product_attention in targets
    assert torch.matmul not in targets and F.softmax not in targets
    # sdpa against matmul-softmax-matmul: each output a softmax-weighted mean of SEQ values,
    # each of them a HEAD_DIM-term dot product, all in float32
    bound = 4 * (HEAD_DIM + SEQ) * 2 ** -24 * expected.abs().max().item()
    torch.testing.assert_close(graph_module(x, mask), expected, rtol=0, atol=bound)


def test_unit_scale_converts_written_attention_whole() -> None:
    torch.manual_seed(0)
    x, mask = torch.randn(4, SEQ, HEADS * HEAD_DIM), _additive(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, report = unit_scale_with_report(WrittenAttention(), (x, mask))
    left = " ".join(report.unconverted)
    assert "matmul" not in left and "softmax" not in left and "truediv" not in left, left
