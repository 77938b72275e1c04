"""Helpers for writing graph transforms (unit-scaling's ``unit_scaling.transforms.utils`` path;
written in :mod:`ipu_unit_scaling.transforms.compose`; its type variable ``T`` in
:mod:`ipu_unit_scaling.ops.torch_arguments`)."""
from __future__ import annotations

from ..ops.torch_arguments import T
from .compose import (
    Backend,
    M,
    apply_transform,
    patch_to_expand_modules,
    replace_node_with_function,
    torch_nn_modules_to_user_modules,
)

__all__ = ["Backend", "M", "T", "apply_transform", "patch_to_expand_modules",
           "replace_node_with_function", "torch_nn_modules_to_user_modules"]
