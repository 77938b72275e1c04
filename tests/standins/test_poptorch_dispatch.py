"""``below_autograd`` of the PopTorch stand-in: inside it an op runs its own kernels, below
the Autograd key, so it records no gradient function; on leaving it (normally or by an
exception, on torch 2.0's guard object as on the context manager of later torch) autograd
records again."""
from __future__ import annotations

import pytest
import torch

from ipu_standins.poptorch._dispatch import below_autograd


def _records_autograd() -> bool:
    x = torch.ones(2, requires_grad=True)
    return (x * 2).grad_fn is not None


def test_inside_no_gradient_function_is_recorded():
    x = torch.ones(2, requires_grad=True)
    assert _records_autograd()
    with below_autograd():
        y = x * 3
        assert y.grad_fn is None and not _records_autograd()
    assert torch.equal(y, torch.full((2,), 3.0))  # the kernel itself ran
    assert _records_autograd()


def test_autograd_comes_back_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"):
        with below_autograd():
            raise RuntimeError("inside")
    assert _records_autograd()
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_nested_uses_unwind_in_order():
    with below_autograd():
        with below_autograd():
            assert not _records_autograd()
        assert not _records_autograd()
    assert _records_autograd()
