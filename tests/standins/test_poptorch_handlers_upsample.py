"""Upsampling modes PopTorch's handlers refuse (``ReshapeOps.cpp``): linear and trilinear."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch


@pytest.mark.parametrize("mode, shape", [("linear", (1, 2, 3)), ("trilinear", (1, 2, 3, 4, 5))])
def test_linear_and_trilinear_upsampling_are_refused(mode, shape):
    model = poptorch.inferenceModel(torch.nn.Upsample(scale_factor=2, mode=mode))
    with pytest.raises(poptorch.Error, match="only 'nearest' is supported"):
        model(torch.randn(*shape))


def test_nearest_upsampling_compiles():
    model = poptorch.inferenceModel(torch.nn.Upsample(scale_factor=2, mode="nearest"))
    x = torch.arange(3.0).reshape(1, 1, 3)
    assert torch.equal(model(x), torch.tensor([[[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]]]))
