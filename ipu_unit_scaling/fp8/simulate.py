"""simulate_fp8: swap a model's linear layers (and optionally attention) for FP8 versions."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from .attention import FP8AttentionFn
from .fp8_config import FP8Config
from .linear import FP8Linear, fp8_linear, fp8_linear_values, values_path_applies

__all__ = ["simulate_fp8", "FP8UnitScaledLinear", "ATTENTION_ATTRIBUTES"]

# Attribute names under which modules keep their attention function.
ATTENTION_ATTRIBUTES = ("attention_fn", "attention")


class FP8UnitScaledLinear(FP8Linear):
    """FP8 version of the unit-scaled ``uu.Linear``: same scales, FP8 casts in between.

    The casts see the unscaled input, weight and output gradient (all near unit variance in a
    unit-scaled model); the forward output scale is applied to the FP8 matmul's product and the
    backward scales of the input and weight to their gradients' products (inside the GEMMs,
    where the product is computed from FP8 values on the CPU).
    """

    constraint: Optional[str]
    # `U.linear`'s exponents: (1, 0.5, 0.5) for a `uu.LinearReadout`.
    scale_power: Tuple[float, float, float] = (0.5, 0.5, 0.5)
    # The `uu.Linear`'s `AttentionProjection`, if unit_scale marked it an attention projection.
    attention_projection: Any = None

    @classmethod
    def from_unit_scaled(cls, linear: nn.Linear, config: Optional[FP8Config] = None,
                         site: str = "linear") -> FP8UnitScaledLinear:
        new = cls.from_linear(linear, config, site)
        new.constraint = linear.constraint  # type: ignore[assignment]
        new.scale_power = getattr(linear, "scale_power", new.scale_power)
        new.attention_projection = getattr(linear, "attention_projection", None)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Imported here: the unit-scaled core imports nothing from fp8, and fp8 stays usable alone.
        from .. import ops as U
        from ..ops.scaling_primitive import scale_bwd, scale_fwd

        batch_size = max(1, x.numel() // x.shape[-1])
        output_scale, grad_input_scale, grad_weight_scale = U.linear_scales(
            self.in_features, self.out_features, batch_size, self.constraint, self.scale_power)
        # Its gradient is a sum over the batch: unit variance after 1/sqrt(batch).
        bias_scale = batch_size ** -0.5
        rule = self.attention_projection
        if rule is not None and x.dim() >= 2:
            grad_weight_scale *= rule.weight_grad_scale(x.shape[-2])
            bias_scale *= rule.bias_grad_scale(x.shape[-2])
        if values_path_applies(x, self.weight, self.bias, self.use_scaled_mm):
            # One autograd node: the scales ride in the GEMMs around the FP8 values.
            scales = (output_scale, grad_input_scale, grad_weight_scale, bias_scale)
            return fp8_linear_values(x, self.weight, self.bias, self.config, self.site, scales)
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(self.weight, grad_weight_scale)
        y = fp8_linear(x, weight, None, self.config, self.site, self.use_scaled_mm)
        y = scale_fwd(y, output_scale)
        if self.bias is not None:
            y = y + scale_bwd(self.bias, bias_scale)
        return y


def _fp8_version(module: nn.Module, config: FP8Config, site: str) -> Optional[nn.Module]:
    if isinstance(module, FP8Linear):
        return None  # already converted
    if isinstance(module, nn.Linear) and hasattr(module, "constraint"):
        return FP8UnitScaledLinear.from_unit_scaled(module, config, site)
    if type(module) is nn.Linear:
        return FP8Linear.from_linear(module, config, site)
    return None


def simulate_fp8(model: nn.Module, config: Optional[FP8Config] = None) -> nn.Module:
    """Make ``model``'s matmuls FP8, in place, and return it.

    - Every ``torch.nn.Linear`` becomes an :class:`FP8Linear` and every unit-scaled
      ``uu.Linear`` an :class:`FP8UnitScaledLinear`; they share the original parameters. Other
      ``nn.Linear`` subclasses are left alone (e.g. ``nn.MultiheadAttention``'s ``out_proj``,
      whose forward that module never calls). A bare ``nn.Linear`` passed as ``model`` cannot
      be replaced in place: its FP8 version is returned.
    - With ``config.attention``, every module's attention function, an ``attention_fn`` or
      ``attention`` attribute that is a plain callable (not a submodule), as on
      ``uu.SelfAttention``, is
      wrapped to run inside :func:`fp8_attention`: the ``F.scaled_dot_product_attention`` it
      calls (``U.scaled_dot_product_attention`` calls it too, keeping its unit scaling around
      it) runs its two matmuls in FP8.

    Casts are recorded under each module's qualified name in :func:`fp8_stats`.
    """
    config = config or FP8Config()
    root = _fp8_version(model, config, "linear")
    if root is not None:
        return root
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            site = f"{parent_name}.{child_name}" if parent_name else child_name
            replacement = _fp8_version(child, config, site)
            if replacement is not None:
                setattr(parent, child_name, replacement)
    if config.attention:
        for name, module in model.named_modules():
            for attribute in ATTENTION_ATTRIBUTES:
                fn = getattr(module, attribute, None)
                if callable(fn) and not isinstance(fn, (nn.Module, FP8AttentionFn)):
                    setattr(module, attribute, FP8AttentionFn(fn, config, name or "attention"))
    return model
