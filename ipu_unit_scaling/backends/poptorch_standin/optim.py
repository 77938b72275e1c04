"""``poptorch.optim`` for the PopTorch stand-in (work in progress: signatures first).

The numerics follow PopART's update rules; see the final docstring once filled in.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = [
    "VariableAttributes",
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "LAMB",
    "from_torch_optimizer",
]


class VariableAttributes:
    def __init__(self, variable_attributes: List[str], allowed_attributes: List[str]) -> None:
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:
        return attr not in self._variable_attributes

    def markAsConstant(self, attr: str) -> None:
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:
        if attr not in self._variable_attributes:
            self._variable_attributes.append(attr)


class Optimizer:
    loss_scaling: float = 1.0


class SGD(Optimizer, torch.optim.SGD):
    def __init__(self, params: Iterable, lr: float, momentum: Optional[float] = None,
                 dampening: Optional[float] = None, weight_decay: Optional[float] = None,
                 nesterov: Optional[bool] = None, maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None, differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None, velocity_scaling: Optional[float] = None,
                 use_combined_accum: Optional[bool] = None, accum_type: Optional[torch.dtype] = None,
                 velocity_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        torch.optim.SGD.__init__(self, params, lr=lr, momentum=momentum or 0.0,
                                 dampening=dampening or 0.0, weight_decay=weight_decay or 0.0,
                                 nesterov=bool(nesterov))
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling


class Adam(Optimizer, torch.optim.Adam):
    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, amsgrad: Optional[bool] = None,
                 foreach: Optional[bool] = None, maximize: Optional[bool] = None,
                 capturable: Optional[bool] = None, differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None, loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        kw: Dict[str, Any] = {k: v for k, v in dict(lr=lr, betas=betas, eps=eps,
                                                   weight_decay=weight_decay).items() if v is not None}
        torch.optim.Adam.__init__(self, params, **kw)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling


class AdamW(Optimizer, torch.optim.AdamW):
    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, amsgrad: Optional[bool] = None,
                 maximize: Optional[bool] = None, foreach: Optional[bool] = None,
                 capturable: Optional[bool] = None, differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None, loss_scaling: Optional[float] = None,
                 bias_correction: Optional[bool] = None, accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        kw: Dict[str, Any] = {k: v for k, v in dict(lr=lr, betas=betas, eps=eps,
                                                   weight_decay=weight_decay).items() if v is not None}
        torch.optim.AdamW.__init__(self, params, **kw)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling


class RMSprop(Optimizer, torch.optim.RMSprop):
    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 alpha: Optional[float] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, momentum: Optional[float] = None,
                 centered: Optional[bool] = None, foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None, differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None, accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 use_tf_variant: Optional[bool] = None) -> None:
        kw: Dict[str, Any] = {k: v for k, v in dict(lr=lr, alpha=alpha, eps=eps,
                                                   weight_decay=weight_decay, momentum=momentum,
                                                   centered=centered).items() if v is not None}
        torch.optim.RMSprop.__init__(self, params, **kw)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling


class LAMB(Optimizer, torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, bias_correction: Optional[bool] = None,
                 loss_scaling: Optional[float] = None, max_weight_norm: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None) -> None:
        defaults = dict(lr=1e-3 if lr is None else lr, betas=betas or (0.9, 0.999),
                        eps=1e-8 if eps is None else eps,
                        weight_decay=1e-2 if weight_decay is None else weight_decay,
                        max_weight_norm=65500.0 if max_weight_norm is None else max_weight_norm)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling


def from_torch_optimizer(optimizer: torch.optim.Optimizer) -> Optimizer:
    """Return the stand-in optimizer equivalent to a plain torch optimizer (placeholder)."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    raise NotImplementedError("work in progress")
