"""U under torch.compile, no_grad and broadcasting: one graph for the GPT, same results."""
from __future__ import annotations

import pytest
import torch

import ipu_unit_scaling.functional as U
from ipu_unit_scaling import GPT
from ipu_unit_scaling.ops import activation_ops

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics


def test_gelu_constants_do_not_depend_on_the_grad_mode():
    compute = activation_ops._gelu_stds.__wrapped__  # bypass the cache: recompute in each mode
    reference = compute("tanh")
    with torch.no_grad():
        assert compute("tanh") == reference
    with torch.inference_mode():
        assert compute("tanh") == reference


def test_gpt_training_forward_compiles_to_one_graph():
    dynamo = pytest.importorskip("torch._dynamo")
    try:
        dynamo.eval_frame.check_if_dynamo_supported()
    except RuntimeError as error:  # torch 2.0 on Python 3.11
        pytest.skip(f"torch.compile unavailable: {error}")
    if torch.__version__ < (2, 1):  # 2.0's explain(model, *args) returns a tuple
        pytest.skip("needs torch._dynamo.explain(model)(*args) (torch >= 2.1)")
    explain = dynamo.explain
    torch.manual_seed(0)
    model = GPT(vocab_size=16, hidden_size=8, depth=1, heads=2, seq_len=4)
    ids = torch.randint(16, (2, 4))
    result = explain(model)(ids, ids)
    assert result.graph_break_count == 0, [str(r.reason)[:200] for r in result.break_reasons]


@pytest.mark.parametrize(
    "residual_shape, skip_shape, skip_dtype",
    [
        ((3, 4), (3, 4), torch.float32),
        ((3, 4), (4,), torch.float32),
        ((4,), (3, 4), torch.float32),
        ((3, 4), (3, 4), torch.float16),
    ],
)
def test_residual_add_broadcasts_and_promotes_like_a_sum(residual_shape, skip_shape, skip_dtype):
    torch.manual_seed(0)
    residual = torch.randn(residual_shape).requires_grad_()
    skip = torch.randn(skip_shape).to(skip_dtype).requires_grad_()
    out = U.residual_add(residual, skip, tau=0.5)
    branch_weight, skip_weight = 0.5 / 1.25**0.5, 1 / 1.25**0.5
    expected = residual.detach().double() * branch_weight + skip.detach().double() * skip_weight
    assert out.shape == expected.shape
    assert out.dtype == torch.promote_types(torch.float32, skip_dtype)
    assert torch.allclose(out.double(), expected, rtol=1e-3, atol=1e-3)
    out.backward(torch.ones_like(out))
    # Backwards, both pass the gradient through unscaled (residual_split scales it).
    uses = torch.ones(out.shape, dtype=torch.float64)
    assert torch.allclose(residual.grad.double(), uses.sum_to_size(residual_shape))
    assert torch.allclose(skip.grad.double(), uses.sum_to_size(skip_shape), rtol=1e-3)
