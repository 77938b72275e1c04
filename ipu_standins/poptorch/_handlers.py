"""Which ATen ops PopTorch can lower, from PopTorch's own sources (SDK 3.3/3.4).

An ATen op that reaches PopTorch's dispatcher (after PyTorch's own decompositions) is
compiled only if PopTorch has a handler for it; otherwise compilation stops with
"Unsupported ops found". The lists below were read from graphcore/poptorch at commit
c2a8b17762f1 (September 2023), the newest public source:

- ``HANDLED_OPS``: every ``registerHandler(c10::aten::<op>, ...)`` in
  ``poptorch/source/popart_canonicalization/``;
- ``DISPATCHER_OPS``: the ops ``poptorch/source/dispatch_tracer/RegisterOptionalAtenOps.cpp.inc``
  and ``RegisterAtenOverloads.cpp`` implement in the dispatcher itself, plus ``_to_copy``
  (dtype casts: ``docs/user_guide/supported_ops.rst``, "16-bit float operations", says
  tensors are cast freely) and ``lift_fresh_copy`` (a constant tensor in the model code);
- ``HOST_READ_OPS``: refused while tracing (``RegisterAtenOverloads.cpp``: "aten::item is only
  supported in eager mode").
- ``ARGUMENT_RULES``: handlers that exist but refuse some arguments, written by hand from the
  handlers' checks (``scripts/poptorch_ops.py --refusals`` lists every check to compare with).

``scripts/poptorch_ops.py`` regenerates the first two from a poptorch checkout. In-place
variants (``mul_``) are checked as their out-of-place op: PopTorch's in-place pass
(``poptorch/source/InplaceOps.cpp``) rewrites them that way.

None of these apply to an op whose inputs are all compile-time constants (built inside the
forward from Python values, not from inputs, parameters or buffers, and not random):
PopTorch evaluates those on the host before any handler runs
(``type_and_constant_canonicalization/EvaluateConstexprs.cpp``, called before
``canonicalize`` and ``errorOnUnsupportedAten`` in ``LowerToPopartFactories.cpp``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Mapping, Tuple

import torch

__all__ = ["HANDLED_OPS", "DISPATCHER_OPS", "HOST_READ_OPS", "ArgumentRule", "ARGUMENT_RULES",
           "is_supported", "base_name"]

HANDLED_OPS: FrozenSet[str] = frozenset((
    "Int", "__and__", "__or__", "__xor__", "_cdist_forward", "_convolution",
    "_embedding_bag", "_log_softmax", "_prelu_kernel", "_reshape_alias", "_softmax",
    "_unsafe_view", "_weight_norm", "abs", "acos", "acosh", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "add", "addcdiv", "addcmul", "addmm",
    "addmv", "all", "amax", "amin", "any", "arange", "argmax", "argmin", "argsort",
    "as_strided", "asin", "asinh", "atan", "atan2", "atanh", "avg_pool1d", "avg_pool2d",
    "avg_pool3d", "baddbmm", "batch_norm", "bernoulli", "bilinear", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "bincount", "bitwise_and", "bitwise_not",
    "bitwise_or", "bitwise_xor", "bmm", "broadcast_to", "bucketize", "cartesian_prod",
    "cat", "cdist", "ceil", "celu", "chunk", "clamp", "clamp_max", "clamp_min", "clone",
    "col2im", "constant_pad_nd", "contiguous", "conv2d", "convolution",
    "convolution_overrideable", "copy_", "cos", "cosh", "cosine_embedding_loss",
    "cosine_similarity", "count_nonzero", "cross", "cross_entropy_loss", "ctc_loss",
    "cumprod", "cumsum", "detach", "div", "dot", "dropout", "einsum", "elu", "embedding",
    "embedding_bag", "eq", "erf", "erfc", "exp", "expand", "expand_as", "expm1",
    "exponential_", "feature_dropout", "flatten", "flip", "floor", "floor_divide", "fmod",
    "frac", "frobenius_norm", "full", "full_like", "gather", "ge", "gelu", "glu",
    "group_norm", "gru", "gt", "hardshrink", "hardsigmoid", "hardswish", "hardtanh",
    "hinge_embedding_loss", "im2col", "index", "index_fill", "index_put", "index_reduce",
    "index_select", "instance_norm", "is_complex", "isnan", "kl_div", "l1_loss",
    "layer_norm", "le", "leaky_relu", "linalg_cross", "linalg_vector_norm", "linear", "log",
    "log10", "log1p", "log2", "log_sigmoid", "log_sigmoid_forward", "log_softmax",
    "logical_and", "logical_not", "logical_or", "logsumexp", "lstm", "lt",
    "margin_ranking_loss", "masked_fill", "matmul", "max", "max_pool1d",
    "max_pool1d_with_indices", "max_pool2d", "max_pool2d_with_indices", "max_pool3d",
    "max_pool3d_with_indices", "maximum", "mean", "median", "meshgrid", "min", "minimum",
    "mish", "mkldnn_convolution", "mm", "mse_loss", "mul", "multilabel_soft_margin_loss",
    "mv", "nansum", "narrow", "native_batch_norm", "native_group_norm", "native_layer_norm",
    "ne", "neg", "new_full", "new_ones", "new_zeros", "nll_loss2d", "nll_loss2d_forward",
    "nll_loss_forward", "nll_loss_nd", "norm", "normal", "normal_", "numpy_T", "one_hot",
    "ones", "ones_like", "pairwise_distance", "permute", "pixel_shuffle",
    "poisson_nll_loss", "pow", "prelu", "prod", "rand", "randint", "randn", "random_",
    "randperm", "reciprocal", "reflection_pad1d", "reflection_pad2d", "relu", "remainder",
    "repeat", "replication_pad1d", "replication_pad2d", "replication_pad3d", "reshape",
    "rnn_relu", "rnn_tanh", "roll", "round", "rrelu", "rrelu_with_noise", "rsqrt", "rsub",
    "scatter", "scatter_add", "scatter_reduce", "select", "selu", "sigmoid", "sign", "silu",
    "sin", "sinh", "size", "slice", "smooth_l1_loss", "soft_margin_loss", "softmax",
    "softplus", "softshrink", "sort", "split", "split_with_sizes", "sqrt", "square",
    "squeeze", "stack", "std", "std_mean", "sub", "sum", "t", "take_along_dim", "tan",
    "tanh", "tensordot", "threshold", "to", "topk", "transpose", "transpose_",
    "triplet_margin_loss", "triu", "true_divide", "trunc", "type_as", "unbind", "unfold",
    "uniform_", "unsafe_chunk", "unsqueeze", "upsample_bicubic2d", "upsample_bilinear2d",
    "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "upsample_trilinear3d", "var", "var_mean", "view", "where", "zeros", "zeros_like",
))

DISPATCHER_OPS: FrozenSet[str] = frozenset((
    "_prelu_kernel", "_to_copy", "_unsafe_view", "_weight_norm_interface",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "alias", "all",
    "amax", "amin", "any", "argsort", "avg_pool2d", "avg_pool3d", "baddbmm", "bilinear",
    "binary_cross_entropy_with_logits", "binary_cross_entropy_with_logits_backward",
    "bucketize", "constant_pad_nd", "convolution", "convolution_backward", "copy_",
    "cosine_embedding_loss", "ctc_loss", "detach", "dropout", "embedding", "empty",
    "empty_strided", "expand", "feature_dropout", "feature_dropout_", "fps",
    "frobenius_norm", "gather", "grid", "hinge_embedding_loss", "index", "index_put",
    "index_put_", "kl_div", "l1_loss", "lift_fresh_copy", "lstm", "margin_ranking_loss",
    "masked_fill", "max", "max_pool1d", "max_pool2d", "max_pool3d", "maximum", "median",
    "min", "minimum", "mse_loss", "native_group_norm", "native_layer_norm", "nearest",
    "nearest_batch_list", "nll_loss2d_forward", "nll_loss_forward", "one_hot", "permute",
    "poisson_nll_loss", "repeat", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_max", "scatter_min", "scatter_mul", "scatter_reduce", "scatter_reduce_",
    "select", "select_scatter", "slice", "smooth_l1_loss", "soft_margin_loss",
    "spline_basis", "spline_weighting", "split_with_sizes", "squeeze", "squeeze_",
    "take_along_dim", "topk", "transpose", "transpose_", "triplet_margin_loss", "trunc",
    "unsqueeze",
))

HOST_READ_OPS: FrozenSet[str] = frozenset(("_local_scalar_dense", "item", "is_nonzero", "equal"))


# In-place ops whose out-of-place form is not their name without the "_"
# (``poptorch/source/include/poptorch/InplaceOpsPyTorch.hpp_nolint``).
_IN_PLACE_TO_OUT_OF_PLACE: Dict[str, str] = {"zero_": "zeros_like", "fill_": "full_like"}


def base_name(aten_name: str) -> str:
    """The out-of-place name of an in-place op (``mul_`` -> ``mul``, ``zero_`` ->
    ``zeros_like``)."""
    if aten_name in _IN_PLACE_TO_OUT_OF_PLACE:
        return _IN_PLACE_TO_OUT_OF_PLACE[aten_name]
    if aten_name.endswith("_") and not aten_name.endswith("__"):
        return aten_name[:-1]
    return aten_name


# Ops whose kernel for every backend (CompositeExplicitAutograd) calls an op PopTorch's
# dispatcher implements: PopTorch sees that op, a Python dispatch mode the outer one
# (``torch.rrelu`` in eval mode makes its unused noise with ``empty_like``).
_EXPLICIT_COMPOSITES: Dict[str, str] = {"empty_like": "empty", "new_empty": "empty"}

# Ops that a newer torch's composites call where torch 2.0.1's (the Poplar SDK's) call one that
# PopTorch handles: under torch.inference_mode (Lightning's validation and test) an eval-mode
# batch norm reaches the dispatcher as `_native_batch_norm_legit_no_training` on torch >= 2.1,
# as `native_batch_norm` on 2.0.1 (`_batch_norm_impl_index`).
NEWER_TORCH_NAMES: Dict[str, str] = {"_native_batch_norm_legit_no_training": "native_batch_norm"}


def is_supported(aten_name: str) -> bool:
    """Whether PopTorch lowers the ATen op ``aten_name`` (an overload packet name, e.g. "mm")."""
    aten_name = _EXPLICIT_COMPOSITES.get(aten_name, NEWER_TORCH_NAMES.get(aten_name, aten_name))
    if aten_name in HANDLED_OPS or aten_name in DISPATCHER_OPS:
        return True
    base = base_name(aten_name)
    return base != aten_name and (base in HANDLED_OPS or base in DISPATCHER_OPS)


# ------------------------------------------------------------ handlers that refuse arguments

IsConstant = Callable[[Any], bool]


@dataclass(frozen=True)
class ArgumentRule:
    """A handler's refusal: ``refuses(arguments, is_constant)`` is true for the arguments (by
    their ATen schema names) that the handler stops compilation for."""

    refuses: Callable[[Mapping[str, Any], IsConstant], bool]
    reason: str
    source: str  # the handler's file in poptorch/source/popart_canonicalization/


def _all_tensors_of(arguments: Mapping[str, Any], dtype: torch.dtype) -> bool:
    tensors = [v for v in arguments.values() if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.dtype == dtype for t in tensors)


def _one_of_two_given(first: str, second: str) -> Callable[[Mapping[str, Any], IsConstant], bool]:
    return lambda a, _: (a.get(first) is None) != (a.get(second) is None)


_EIGHT_BIT = ArgumentRule(
    lambda a, _: _all_tensors_of(a, torch.uint8) or _all_tensors_of(a, torch.int8),
    "Poplar has no bitwise ops on 8-bit integers; cast to int32 first", "BitwiseOps.cpp")
_AFFINE = ArgumentRule(
    _one_of_two_given("weight", "bias"),
    "the normalisation takes both weight and bias, or neither", "NormalizationOps.cpp")
_LOSS_WEIGHT = ArgumentRule(
    lambda a, _: a.get("weight") is not None,
    "a class weight is not supported by the NLL / cross-entropy handler", "LossOps.cpp")
_EMBEDDING = ArgumentRule(
    lambda a, _: bool(a.get("scale_grad_by_freq")) or bool(a.get("sparse")),
    "scale_grad_by_freq and sparse gradients are not supported", "EmbeddingOps.cpp")

_UNSUPPORTED_UPSAMPLE = ArgumentRule(
    lambda a, _: True, "Unsupported upsample mode: currently only 'nearest' is supported "
    "(and bilinear, bicubic)", "ReshapeOps.cpp")

ARGUMENT_RULES: Dict[str, Tuple[ArgumentRule, ...]] = {
    "triu": (ArgumentRule(
        lambda a, _: True,
        "torch.triu compiles only when constant-folded: build its input inside forward from "
        "Python values (torch.ones(...).triu()), not from inputs, parameters or buffers",
        "TensorOps.cpp"),),
    "tril": (ArgumentRule(
        lambda a, _: True,
        "PopTorch has no handler for tril, so it compiles only when constant-folded: build its "
        "input inside forward from Python values, not from inputs, parameters or buffers",
        "TensorOps.cpp (no tril handler)"),),
    "as_strided": (ArgumentRule(
        lambda a, _: True, "the as_strided handler refuses every call", "ReshapeOps.cpp"),),
    "upsample_linear1d": (_UNSUPPORTED_UPSAMPLE,),
    "upsample_trilinear3d": (_UNSUPPORTED_UPSAMPLE,),
    "embedding": (_EMBEDDING,),
    "_embedding_bag": (
        _EMBEDDING,
        ArgumentRule(lambda a, _: (a.get("padding_idx") is not None
                                   and int(a["padding_idx"]) >= 0),
                     "padding_idx is not supported", "EmbeddingOps.cpp"),
        ArgumentRule(lambda a, is_constant: not is_constant(a.get("offsets")),
                     "the offsets must be a compile-time constant", "EmbeddingOps.cpp"),
    ),
    "nll_loss_forward": (_LOSS_WEIGHT,),
    "nll_loss2d_forward": (_LOSS_WEIGHT,),
    "nll_loss_nd": (_LOSS_WEIGHT,),
    "native_layer_norm": (_AFFINE,),
    "native_group_norm": (_AFFINE,),
    "native_batch_norm": (
        _AFFINE,
        ArgumentRule(_one_of_two_given("running_mean", "running_var"),
                     "batch norm takes both running statistics, or neither",
                     "NormalizationOps.cpp"),
    ),
    # The meta function's check (dispatch_tracer/RegisterMetaOps.cpp.inc): the handler makes
    # a tensor of minlength bins.
    "bincount": (ArgumentRule(
        lambda a, _: int(a.get("minlength", 0)) <= 0,
        "Bincount `minlength` must be specified and must be a constant. On the IPU MK2 "
        "platform the minimum length is also the maximum length", "OtherOps.cpp"),),
    "bitwise_and": (_EIGHT_BIT,),
    "bitwise_or": (_EIGHT_BIT,),
    "bitwise_xor": (_EIGHT_BIT,),
    "bitwise_not": (_EIGHT_BIT,),
    "__and__": (_EIGHT_BIT,),
    "__or__": (_EIGHT_BIT,),
    "__xor__": (_EIGHT_BIT,),
}
ARGUMENT_RULES.update({newer: ARGUMENT_RULES[older] for newer, older in NEWER_TORCH_NAMES.items()})
