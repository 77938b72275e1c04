"""Per-tensor scale tracking: one forward and backward pass, one record per tensor.

`record_scales` records, in graph order, each op's output (role "activation"), each weight
("weight"), and their gradients ("gradient"), with the std, the absolute max, and the
fractions that a static cast (scale 2**0) to each chosen format would flush to zero or push
out of range.

An "op" is a leaf module (one with no children, such as a Linear), a unit-scaled function of
this package (one record for `U.gelu`, not one per multiply inside it), or a torch function
called outside both (a residual `+`, `F.gelu`). Ops that only view, index or move data are not
recorded.

The package's two other views of scales are unit-scaling's: `transforms.track_scales`, a copy
of a module that records metrics on its captured graph at every call, and
`utils.analyse_module`, a module's forward code annotated with each tensor's std.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["ScaleRecord", "RangeFormat", "range_format", "cast_fractions", "record_scales"]


@dataclass(frozen=True)
class RangeFormat:
    """What a static cast to a number format can hold."""

    name: str
    max: float
    min_subnormal: float
    # Magnitudes above it round past max; at it, they do when ties round up (odd max mantissa).
    overflow_threshold: float
    tie_overflows: bool


def range_format(name: str) -> RangeFormat:
    """"FP16", or an FP8 format name of `ipu_unit_scaling.fp8` ("F143", "F152", ...)."""
    if name.upper() == "FP16":
        info = torch.finfo(torch.float16)
        mantissa_bits = 10
        exponent = math.frexp(info.max)[1] - 1
        ulp_at_max = 2.0 ** (exponent - mantissa_bits)
        return RangeFormat("FP16", info.max, info.tiny * info.eps, info.max + ulp_at_max / 2, True)
    from ..fp8 import get_format

    fmt = get_format(name)
    return RangeFormat(
        fmt.name, fmt.max, fmt.min_subnormal, fmt.overflow_threshold,
        fmt.tie_at_threshold_overflows,
    )


def cast_fractions(tensor: Tensor, fmt: Union[str, RangeFormat]) -> Tuple[float, float]:
    """(underflow, overflow) fractions of `tensor`'s elements under a static cast to `fmt`.

    Underflow: non-zero values that round to zero (|x| at most half the smallest subnormal;
    the tie goes to the even code, zero). Overflow: values that round beyond the largest finite
    value (then saturated or NaN, by the cast's policy), and non-finite values.
    """
    fmt = range_format(fmt) if isinstance(fmt, str) else fmt
    magnitude = tensor.detach().abs().double()
    count = max(1, magnitude.numel())
    underflow = ((magnitude > 0) & (magnitude <= fmt.min_subnormal / 2)).sum().item()
    beyond = magnitude > fmt.overflow_threshold
    if fmt.tie_overflows:
        beyond |= magnitude == fmt.overflow_threshold
    overflow = (beyond | ~torch.isfinite(magnitude)).sum().item()
    return underflow / count, overflow / count


@dataclass
class ScaleRecord:
    """One tensor of one op.

    `index` is the op's position in the forward pass, shared by its output's gradient record;
    `underflow` / `overflow` map format names to fractions of elements (see `cast_fractions`).
    """

    index: int
    op: str
    role: str
    std: float
    absmax: float
    numel: int
    underflow: Dict[str, float] = field(default_factory=dict)
    overflow: Dict[str, float] = field(default_factory=dict)

    @property
    def log2_std(self) -> float:
        return math.log2(self.std) if self.std > 0 else -math.inf


def _statistics(
    index: int, op: str, role: str, tensor: Tensor, formats: Sequence[RangeFormat]
) -> ScaleRecord:
    values = tensor.detach().double()
    record = ScaleRecord(
        index, op, role, values.std(unbiased=False).item(), values.abs().max().item(),
        values.numel(),
    )
    for fmt in formats:
        record.underflow[fmt.name], record.overflow[fmt.name] = cast_fractions(values, fmt)
    return record


# Functions of this package whose internal torch calls make up one unit-scaled op.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OP_FILES = {
    os.path.join(_PACKAGE_DIR, "ops", "unit_ops.py"),
    os.path.join(_PACKAGE_DIR, "ops", "activation_ops.py"),
    os.path.join(_PACKAGE_DIR, "ops", "attention_ops.py"),
    os.path.join(_PACKAGE_DIR, "ops", "loss_ops.py"),
    os.path.join(_PACKAGE_DIR, "ops", "scaling_primitive.py"),
    os.path.join(_PACKAGE_DIR, "transforms", "replacements.py"),
}

# Calls that view, index, move or describe data: not ops for scale tracking.
_NOT_OPS = {
    "view", "view_as", "reshape", "permute", "transpose", "flatten", "unflatten", "contiguous",
    "unbind", "split", "chunk", "squeeze", "unsqueeze", "expand", "expand_as", "__getitem__",
    "to", "type", "float", "half", "bfloat16", "detach", "clone", "size", "dim", "numel",
    "__get__", "__set__", "t", "narrow", "arange", "zeros", "ones", "empty", "full", "tril",
    "triu", "zeros_like", "ones_like", "empty_like", "full_like", "randn_like", "cat", "stack",
    "repeat", "long", "int", "bool", "masked_fill", "new_ones", "new_zeros", "type_as",
    "__setitem__", "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__gt__",
    "__invert__", "__and__", "__or__", "all", "any", "isneginf", "isfinite", "sum",
}


class _Tracker(TorchFunctionMode):
    def __init__(self, formats: Sequence[RangeFormat]) -> None:
        super().__init__()
        self.formats = formats
        self.records: List[ScaleRecord] = []
        self.depth = 0  # > 0 inside a recorded leaf module
        self.ops = 0
        self.pending: Optional[Tuple[Any, str, Any]] = None  # (frame, name, last output)
        self.seen_weights: Dict[int, str] = {}
        self.quiet = 0  # > 0 while the tracker computes its own statistics
        self.scopes: List[str] = []  # names of the enclosing container modules

    # ---------------------------------------------------------------- ops

    def statistics(self, index: int, op: str, role: str, tensor: Tensor) -> None:
        self.quiet += 1
        try:
            self.records.append(_statistics(index, op, role, tensor, self.formats))
        finally:
            self.quiet -= 1

    def record_output(self, op: str, output: Any) -> None:
        tensor = _first_float_tensor(output)
        if tensor is None or tensor.numel() < 2:
            return
        index = self.ops
        self.ops += 1
        self.statistics(index, op, "activation", tensor)
        if tensor.requires_grad:

            def on_gradient(grad: Tensor, index: int = index, op: str = op) -> None:
                self.statistics(index, op, "gradient", grad)

            tensor.register_hook(on_gradient)

    def scoped(self, name: str) -> str:
        scope = next((s for s in reversed(self.scopes) if s), "")
        return f"{scope}.{name}" if scope else name

    def flush(self) -> None:
        if self.pending is not None:
            _, name, output = self.pending
            self.pending = None
            self.record_output(name, output)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        output = func(*args, **(kwargs or {}))
        if self.depth > 0 or self.quiet > 0:
            return output
        name = getattr(func, "__name__", str(func))
        op_frame = _outermost_op_frame()
        if op_frame is not None:
            if self.pending is not None and self.pending[0] is not op_frame:
                self.flush()
            if _first_float_tensor(output) is not None and name not in _NOT_OPS:
                op_name = self.scoped(op_frame.f_code.co_name.replace("unit_", ""))
                self.pending = (op_frame, op_name, output)
            elif self.pending is None:
                self.pending = (op_frame, "", None)
            return output
        self.flush()
        if name not in _NOT_OPS:
            self.record_output(self.scoped(name), output)
        return output

    # ---------------------------------------------------------------- modules

    def enter_scope(self, name: str) -> None:
        if self.depth == 0 and self.quiet == 0:
            self.flush()
        self.scopes.append(name)

    def leave_scope(self) -> None:
        if self.depth == 0 and self.quiet == 0:
            self.flush()
        self.scopes.pop()

    def before_module(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0 and self.quiet == 0:
            self.flush()
        self.depth += 1

    def after_module(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        self.record_output(name, output)
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) not in self.seen_weights:
                self.seen_weights[id(param)] = f"{name}.{param_name}"
                self.statistics(self.ops - 1, f"{name}.{param_name}", "weight", param)


def _outermost_op_frame() -> Any:
    """The outermost frame on the stack that runs a unit-scaled op of this package."""
    frame = _getframe(2)
    found = None
    while frame is not None:
        if frame.f_code.co_filename in _OP_FILES:
            found = frame
        frame = frame.f_back
    return found


def _getframe(depth: int) -> Any:
    import sys

    return sys._getframe(depth)


def _first_float_tensor(value: Any) -> Optional[Tensor]:
    if isinstance(value, Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_float_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_float_tensor(list(value.values()))
    return None


def _is_recorded_module(module: nn.Module) -> bool:
    # MultiheadAttention never calls its out_proj child: it is one op.
    return next(module.children(), None) is None or isinstance(module, nn.MultiheadAttention)


def _loss_of(output: Any) -> Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    tensor = _first_float_tensor(output)
    if tensor is None:
        raise ValueError("the model returned no floating-point tensor to differentiate")
    return tensor


def record_scales(
    model: nn.Module,
    inputs: Union[Tensor, Sequence[Any]],
    labels: Optional[Tensor] = None,
    formats: Sequence[str] = ("F143", "F152", "FP16"),
    loss_fn: Optional[Callable[[Any, Tensor], Tensor]] = None,
    seed: int = 0,
) -> List[ScaleRecord]:
    """Run forward and backward once and return one `ScaleRecord` per tensor, in graph order.

    - With `labels` (and no `loss_fn`) the model is called as `model(*inputs, labels)` and must
      return the loss (or a tuple / output object whose first tensor, or `.loss`, is the loss).
    - With `loss_fn`, the loss is `loss_fn(model(*inputs), labels)`.
    - Without either, the output's gradient is unit normal (drawn from `seed`), as the unit
      scaling analysis assumes for a loss of unit-scaled gradient.

    Gradients come from `torch.autograd.grad`: the model's `.grad` fields are not touched.
    Activations are recorded in graph order, then weights in first-use order; gradient records
    arrive in backward order and share their activation's `index`.
    """
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    specs = [range_format(name) for name in formats]
    tracker = _Tracker(specs)
    handles = []
    for name, module in model.named_modules():
        # Converted submodules sit inside wrappers: name them as in the original model.
        name = name.replace("graph_module.inner.", "").replace("graph_module.", "")
        label = name or type(module).__name__
        if _is_recorded_module(module):
            handles.append(module.register_forward_pre_hook(tracker.before_module))
            handles.append(module.register_forward_hook(
                lambda m, a, o, label=label: tracker.after_module(label, m, a, o)
            ))
        else:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, name=name: tracker.enter_scope(name)
            ))
            handles.append(module.register_forward_hook(lambda m, a, o: tracker.leave_scope()))
    try:
        with tracker:
            if labels is not None and loss_fn is None:
                output = model(*inputs, labels)
            else:
                output = model(*inputs)
            tracker.flush()
        if loss_fn is not None:
            target = loss_fn(output, labels)  # type: ignore[arg-type]
            grad_output = None
        elif labels is not None:
            target = _loss_of(output)
            grad_output = None
        else:
            target = _loss_of(output)
            generator = torch.Generator(device="cpu").manual_seed(seed)
            grad_output = torch.randn(
                target.shape, generator=generator, dtype=target.dtype
            ).to(target.device)
        params = [p for p in model.parameters() if p.requires_grad]
        names = {id(p): n for n, p in model.named_parameters()}
        grads = torch.autograd.grad(
            target, params, grad_outputs=grad_output, allow_unused=True
        )
    finally:
        for handle in handles:
            handle.remove()
    for param in params:  # weights read outside any leaf module
        if id(param) not in tracker.seen_weights:
            name = names.get(id(param), "parameter")
            tracker.seen_weights[id(param)] = name
            tracker.records.append(_statistics(tracker.ops, name, "weight", param, specs))
    weight_index = {r.op: r.index for r in tracker.records if r.role == "weight"}
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        name = tracker.seen_weights.get(id(param), names.get(id(param), "parameter"))
        index = weight_index.get(name, tracker.ops)
        tracker.records.append(_statistics(index, name, "gradient", grad, specs))
    return tracker.records
