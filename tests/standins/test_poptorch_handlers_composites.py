"""Ops that PopTorch's dispatcher sees as the op their every-backend kernel calls: ``empty_like``
is ``empty`` there (``RegisterOptionalAtenOps.cpp.inc``), so ``nn.RReLU`` in eval mode, whose
noise tensor comes from ``empty_like``, compiles."""
from __future__ import annotations

import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch._handlers import is_supported


def test_empty_like_and_new_empty_are_supported_as_empty():
    assert is_supported("empty_like") and is_supported("new_empty")
    assert not is_supported("no_such_op_like")


def test_rrelu_in_eval_mode_compiles_and_matches_torch():
    torch.manual_seed(0)
    x = torch.randn(50)
    model = torch.nn.RReLU().eval()
    out = poptorch.inferenceModel(model)(x)
    torch.testing.assert_close(out, model(x))
    assert (out[x < 0] != x[x < 0]).all()  # negative inputs scaled by (lower + upper) / 2
