"""The stand-in's own graph ops (``torch.ops.poptorch.*``): each is one node of the traced
graph, so that the executor finds losses and prints where PopTorch's graph has them.

- ``identity_loss(x, reduction)``: PopTorch's identity loss (0 sum, 1 mean, 2 none);
- ``torch_loss(x)``: marks the result of a torch loss function (``F.mse_loss``, ...), which
  PopTorch lowers to a loss too; the value passes through unchanged;
- ``ipu_print_tensor(x, title, print_gradient)``: prints ``x`` (and its gradient) when run.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from ._dispatch import below_autograd

__all__ = ["LIBRARY", "LOSS_OPS", "identity_loss_op", "torch_loss_op", "print_op"]


def _new_library() -> torch.library.Library:
    try:
        return torch.library.Library("poptorch", "FRAGMENT")
    except ValueError:
        return torch.library.Library("poptorch", "DEF")


LIBRARY = _new_library()
LIBRARY.define("identity_loss(Tensor x, int reduction) -> Tensor")
LIBRARY.define("torch_loss(Tensor x) -> Tensor")
LIBRARY.define("ipu_print_tensor(Tensor x, str title, bool print_gradient) -> Tensor")


def _reduce(x: torch.Tensor, reduction: int) -> torch.Tensor:
    if reduction == 0:
        return x.sum()
    if reduction == 1:
        return x.mean()
    return x.clone()


class _IdentityLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, reduction: int) -> torch.Tensor:
        ctx.shape, ctx.count, ctx.reduction = x.shape, x.numel(), reduction
        with below_autograd():
            return torch.ops.poptorch.identity_loss(x, reduction)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        if ctx.reduction == 2:
            return grad, None
        scale = 1.0 / ctx.count if ctx.reduction == 1 else 1.0
        return (grad * scale).expand(ctx.shape), None


class _PassThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        with below_autograd():
            return torch.ops.poptorch.torch_loss(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Print(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, title: str, print_gradient: bool) -> torch.Tensor:
        ctx.title, ctx.print_gradient = title, print_gradient
        with below_autograd():
            return torch.ops.poptorch.ipu_print_tensor(x, title, print_gradient)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        if ctx.print_gradient:
            print(f"{'Gradient of ' + ctx.title if ctx.title else 'Gradient'}: {grad}")
        return grad, None, None


def _print_kernel(x: torch.Tensor, title: str, print_gradient: bool) -> torch.Tensor:
    if x.device.type != "meta" and not isinstance(x, torch._subclasses.FakeTensor):
        print(f"{title}: {x}" if title else f"{x}")
    return x.clone()


LIBRARY.impl("identity_loss", _reduce, "CompositeExplicitAutograd")
LIBRARY.impl("identity_loss", lambda x, r: _IdentityLoss.apply(x, r), "Autograd")
LIBRARY.impl("torch_loss", lambda x: x.clone(), "CompositeExplicitAutograd")
LIBRARY.impl("torch_loss", lambda x: _PassThrough.apply(x), "Autograd")
LIBRARY.impl("ipu_print_tensor", _print_kernel, "CompositeExplicitAutograd")
LIBRARY.impl("ipu_print_tensor", lambda x, t, p: _Print.apply(x, t, p), "Autograd")

identity_loss_op = torch.ops.poptorch.identity_loss.default
torch_loss_op = torch.ops.poptorch.torch_loss.default
print_op = torch.ops.poptorch.ipu_print_tensor.default
LOSS_OPS = (identity_loss_op, torch_loss_op)
