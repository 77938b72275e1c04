"""``poptorch.ops``: the functions a PopTorch model calls inside ``forward``.

Blocks (``Block``, ``BeginBlock``, ``BlockFunction``) tell the executor which IPU runs what;
:func:`identity_loss` marks the loss; :func:`custom_op` runs the host numerics an op library
registered (:mod:`ipu_standins.poptorch_custom_ops`) and refuses any other op.
Ops that only steer IPU memory or scheduling (``set_available_memory``,
``recomputationCheckpoint``, ``set_overlap_for_input``, ``serializedMatMul``'s plan,
``MultiConv``, ``NameScope``) compute what they wrap.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from ..poptorch_custom_ops import find_op, running_custom_op
from . import _state, enums
from ._args import flatten, rebuild
from ._graph_ops import identity_loss_op, print_op
from ._impl import createPoptorchError, isRunningOnIpu
from .poptorch_core import Error

__all__ = [
    "ipu_print_tensor", "for_loop", "cond", "nop", "dynamic_slice", "dynamic_update",
    "recomputationCheckpoint", "serializedMatMul", "set_available_memory",
    "set_overlap_for_input", "set_overlap_for_output", "Block", "BeginBlock", "BlockFunction",
    "removeBlocks", "custom_op", "CPU", "identity_loss", "MultiConv", "NameScope",
    "ctc_beam_search_decoder",
]


def _need_tensor(value: Any, message: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise createPoptorchError(message.format(type(value)))


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     **print_options: Any) -> torch.Tensor:
    """Print ``tensor`` each time the model runs (and its gradient when training)."""
    return print_op(tensor, title, print_gradient)


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as the model's loss, reduced by ``"sum"``, ``"mean"`` or ``"none"``."""
    codes = {"sum": 0, "mean": 1, "none": 2}
    assert reduction in codes, "Unsupported reduction type!"
    return identity_loss_op(x, codes[reduction])


def for_loop(count: int, body: Callable[..., Any], inputs: List[torch.Tensor]
             ) -> List[torch.Tensor]:
    """Run ``body`` ``count`` times, each run's outputs being the next run's inputs."""
    if not isinstance(inputs, list):
        raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of "
                         "tensors. (Object is not list)")
    for index, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of "
                             f"tensors. (Object contained in list at index {index} is not "
                             "torch.tensor)")
    if _state.TRAINING and _state.ON_IPU:
        raise createPoptorchError("poptorch.for_loop() is only supported in inference")
    values: List[torch.Tensor] = [t.clone() for t in inputs]
    for _ in range(count):
        outputs = body(*values)
        values = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    return values


def cond(condition: torch.Tensor, then_body: Callable[..., Any], then_inps: List[torch.Tensor],
         else_body: Callable[..., Any], else_inps: List[torch.Tensor]) -> List[torch.Tensor]:
    """Both branches on the IPU, the condition choosing the outputs; one branch on the host."""
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise ValueError("poptorch.cond expects then_inps and else_inps tensors to be a list of "
                         "tensors. (Object is not list)")

    if _state.TRAINING and _state.ON_IPU:  # PopART's If has no gradient (Compiler.cpp)
        raise createPoptorchError("poptorch.cond() is only supported in inference.")

    def as_list(value: Any) -> List[torch.Tensor]:
        return [value] if isinstance(value, torch.Tensor) else list(value)

    if not isRunningOnIpu():
        return as_list(then_body(*then_inps) if condition else else_body(*else_inps))
    then_out, else_out = as_list(then_body(*then_inps)), as_list(else_body(*else_inps))
    return [torch.where(condition.to(torch.bool), t, e) for t, e in zip(then_out, else_out)]


def nop(tensor: torch.Tensor) -> torch.Tensor:
    _need_tensor(tensor, "nop must take a torch.tensor argument. {} is not supported.")
    return tensor.clone()


def _check_slice(size: int, step: int = 1) -> None:
    """PopTorch's slice handlers' checks (``SliceOps.cpp``)."""
    if size == 0:
        raise Error("The start and end of a slice must be different.")
    if size < 0:
        raise Error("Taking a slice of a tensor with the end less than the start is not "
                    "supported.")
    if step < 1:
        raise Error("Slicing step must be at least 1")


def _host_start(start: torch.Tensor) -> int:
    if start.dtype not in (torch.int64, torch.int32, torch.int16):
        raise Error("Expected integer typed start tensor")
    return int(start.reshape(-1)[0])


def _ipu_dtype(dtype: torch.dtype) -> torch.dtype:
    """A dtype as the IPU holds it (no 64-bit types)."""
    return {torch.int64: torch.int32, torch.float64: torch.float32}.get(dtype, dtype)


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int,
                  step: int) -> torch.Tensor:
    """``tensor`` sliced along ``dim`` from ``start`` (a tensor) for ``size`` (an int) with
    ``step``. On the host, PopTorch's CPU kernel: a plain slice."""
    _need_tensor(tensor, "dynamic_slice must take a torch.tensor input. {} is not supported.")
    if not isinstance(dim, int):
        raise createPoptorchError("Dimension must be an integer.")
    _need_tensor(start, "Slice start argument to dynamic_slice must be a torch.tensor. {} is "
                 "not supported.")
    if not isinstance(size, int):
        raise createPoptorchError("Size must be an integer.")
    if not isinstance(step, int):
        raise createPoptorchError("Step must be an integer.")
    if not isRunningOnIpu():
        first = _host_start(start)
        return torch.ops.aten.slice(tensor, dim, first, first + size, step)
    _check_slice(size, step)
    length = tensor.shape[dim]
    if length % size:
        raise Error(f"The size of the slice ({size}) must be a factor of the slicing "
                    f"dimension ({length}).")
    index = start.reshape(()).to(torch.long) + torch.arange(0, size, step)
    return tensor.index_select(dim, index)


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,
                   size: int) -> torch.Tensor:
    """``input`` with ``size`` elements along ``dim`` from ``start`` (a tensor) replaced by
    ``src``'s first ones. On the host, PopTorch's CPU kernel: a slice scatter."""
    _need_tensor(input, "dynamic_update must take a torch.tensor input. {} is not supported.")
    if not isinstance(dim, int):
        raise createPoptorchError("Dimension must be an integer.")
    _need_tensor(start, "Slice start argument to dynamic_update must be a torch.tensor. {} is "
                 "not supported.")
    _need_tensor(src, "Src argument to dynamic_update must be a torch.tensor. {} is not "
                 "supported.")
    if not isinstance(size, int):
        raise createPoptorchError("Size must be an integer.")
    if input.dim() != src.dim():
        raise createPoptorchError("input and src tensors must have same dimensionality. "
                                  f"({input.dim()}) vs ({src.dim()})")
    if not isRunningOnIpu():
        first = _host_start(start)
        return torch.slice_scatter(input, src, dim, first, first + size)
    if _ipu_dtype(input.dtype) != _ipu_dtype(src.dtype):
        raise createPoptorchError("input and src tensor must have same dtype. "
                                  f"({_ipu_dtype(input.dtype)} vs {_ipu_dtype(src.dtype)})")
    _check_slice(size)
    # PopART's dynamic update, from ops PopTorch has handlers for: each position along
    # `dim` takes src's element at its offset from start where it is inside the slice.
    shape = [1] * input.dim()
    shape[dim] = input.shape[dim]
    offset = (torch.arange(input.shape[dim]) - start.reshape(()).to(torch.long)).reshape(shape)
    inside = (offset >= 0) & (offset < size)
    taken = src.narrow(dim, 0, size).index_select(dim, offset.reshape(-1).clamp(0, size - 1))
    return torch.where(inside, taken.to(input.dtype), input)


def recomputationCheckpoint(*tensors: Any) -> Any:
    """Recomputation only changes what an IPU keeps live: the values pass through."""
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("All inputs must be tensors")
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor,
                     mode: enums.MatMulSerializationMode, factor: int = 0,
                     keep_precision: bool = False) -> torch.Tensor:
    assert isinstance(keep_precision, bool)
    assert isinstance(factor, int)
    assert isinstance(mode, enums.MatMulSerializationMode)
    return torch.matmul(lhs, rhs)


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float
                         ) -> torch.Tensor:
    _need_tensor(tensor, "You may only set available memory for torch.tensor values. {} is "
                 "not supported.")
    return tensor


def _set_overlap(tensors: Any, mode: enums.OverlapMode, what: str) -> Any:
    values = flatten(tensors)
    if not isinstance(tensors, (torch.Tensor, tuple, list, dict)) or not values:
        raise createPoptorchError(f"You may only set overlap for torch.tensor {what}. "
                                  f"{type(tensors)} is not supported.")
    return rebuild(tensors, list(values))


def set_overlap_for_input(input_tensors: Any, mode: enums.OverlapMode) -> Any:
    return _set_overlap(input_tensors, mode, "inputs")


def set_overlap_for_output(output_tensors: Any, mode: enums.OverlapMode) -> Any:
    return _set_overlap(output_tensors, mode, "outputs")


def _check_id(name: str, value: Any, kind: type) -> None:
    assert value is None or isinstance(value, kind) or (
        isinstance(value, int) and value >= 0), (
        f"{name} must be either a positive integer or a {kind.__name__}")


class Block(torch.nn.Module):
    """``with poptorch.Block(user_id, ipu_id):`` the ops inside run in that block."""

    @staticmethod
    def useAutoId() -> None:
        if _state.STAGE_MANAGER is not None:
            _state.STAGE_MANAGER.resetAutoId()

    @staticmethod
    def start(user_id: Optional[str] = None, ipu_id: Optional[int] = None) -> None:
        if _state.STAGE_MANAGER is not None:
            _state.STAGE_MANAGER.beginStage(user_id, ipu_id)
            _state.BLOCK_ENDED = False

    def __init__(self, user_id: Optional[str] = None, ipu_id: Optional[int] = None) -> None:
        super().__init__()
        _check_id("user_id", user_id, str)
        _check_id("ipu_id", ipu_id, int)
        self._user_id = user_id
        self._ipu_id = ipu_id

    def __enter__(self) -> None:
        Block.start(self._user_id, self._ipu_id)

    def __exit__(self, *exc: Any) -> None:
        if _state.STAGE_MANAGER is not None:
            _state.BLOCK_ENDED = True


class _BeginBlockFunction(torch.nn.Module):
    def __init__(self, function: Callable[..., Any], user_id: Optional[str],
                 ipu_id: Optional[int]) -> None:
        super().__init__()
        self._function, self._user_id, self._ipu_id = function, user_id, ipu_id

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _state.STAGE_MANAGER is not None:
            if self._user_id is None:
                self._user_id = _state.STAGE_MANAGER.nextAutoId()
            _state.STAGE_MANAGER.beginStage(self._user_id, self._ipu_id)
            _state.BLOCK_ENDED = False
        return self._function(*args, **kwargs)


class _BlockHook:
    def __init__(self, user_id: Optional[str], ipu_id: Optional[int]) -> None:
        self._user_id, self._ipu_id = user_id, ipu_id

    def __call__(self, module: torch.nn.Module, inputs: Any) -> None:
        if _state.STAGE_MANAGER is not None:
            if self._user_id is None:
                self._user_id = _state.STAGE_MANAGER.nextAutoId()
            _state.STAGE_MANAGER.beginStage(self._user_id, self._ipu_id)
            _state.BLOCK_ENDED = False

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={self._user_id}, ipu_id={self._ipu_id})"


def BeginBlock(layer_to_call: Any, user_id: Optional[str] = None,
               ipu_id: Optional[int] = None) -> Any:
    """Start a block (on ``ipu_id``) at ``layer_to_call``, a module or a function."""
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return _BeginBlockFunction(layer_to_call, user_id, ipu_id)
        raise createPoptorchError("module is not an instance of torch.nn.Module or function.")
    if any(isinstance(h, _BlockHook) for h in layer_to_call._forward_pre_hooks.values()):
        raise createPoptorchError("module has already been assigned to a block.")
    layer_to_call.register_forward_pre_hook(_BlockHook(user_id, ipu_id))
    return layer_to_call


def removeBlocks(module: torch.nn.Module) -> None:
    assert isinstance(module, torch.nn.Module)
    for child in module.modules():
        child._forward_pre_hooks = collections.OrderedDict(
            (k, h) for k, h in child._forward_pre_hooks.items()
            if not isinstance(h, _BlockHook))


def BlockFunction(user_id: Optional[str] = None, ipu_id: Optional[int] = None
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorator(function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Block(user_id, ipu_id):
                return function(*args, **kwargs)
        return wrapper
    return decorator


# ---------------------------------------------------------------- custom ops
def custom_op(inputs: Sequence[torch.Tensor], name: str, domain: str, domain_version: int,
              example_outputs: Sequence[torch.Tensor],
              attributes: Optional[Dict[str, Any]] = None) -> List[torch.Tensor]:
    """A PopART custom op, run with the host numerics its op library registered
    (:mod:`ipu_standins.poptorch_custom_ops`): one op of the traced graph. An op no library
    registered has no host implementation and is refused."""
    numerics = find_op(domain, name)
    if numerics is None:
        raise createPoptorchError(
            f"custom_op {domain}::{name} (version {domain_version}): no host implementation; "
            "the stand-in runs the ops whose library registered their numerics with "
            "ipu_standins.poptorch_custom_ops")
    with running_custom_op():
        return list(numerics(list(inputs), dict(attributes or {})))


class CPU:
    """Run ``layer_to_call`` on the host inside an IPU model (here: everything is the host)."""

    def __init__(self, layer_to_call: Callable[..., Any], ID: str) -> None:
        self._layer_to_call = layer_to_call
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._ID = ID

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self._layer_to_call(*inputs, **kwargs)


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0,
                            beam_width: int = 100, top_paths: int = 1) -> List[torch.Tensor]:
    raise createPoptorchError("ctc_beam_search_decoder has no host implementation in the "
                              "stand-in")


class MultiConv:
    """Convolutions planned together on an IPU: here each runs as it is. The setters check
    their arguments as PopTorch does and are recorded."""

    def __init__(self) -> None:
        self._options: Dict[str, Any] = {}

    def _record(self, name: str, value: Any) -> MultiConv:
        self._options[name] = value
        return self

    def availableMemoryProportions(self, value: Union[float, List[float]]) -> MultiConv:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if not isinstance(v, float) or not 0.0 <= v <= 1.0:
                raise AssertionError("Invalid availableMemoryProportions!")
        return self._record("availableMemoryProportions", value)

    def partialsTypes(self, value: Any) -> MultiConv:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v not in (torch.float, torch.float32, torch.half, torch.float16):
                raise ValueError("Invalid partials types!")
        return self._record("partialsTypes", value)

    def enableConvDithering(self, value: Union[bool, List[bool]]) -> MultiConv:
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, bool) for v in values):
            raise ValueError("value must be bool or list of bools")
        return self._record("enableConvDithering", value)

    def planType(self, value: enums.MultiConvPlanType) -> MultiConv:
        if not isinstance(value, enums.MultiConvPlanType):
            raise AssertionError("Invalid plan type!")
        return self._record("planType", value)

    def perConvReservedTiles(self, value: int) -> MultiConv:
        assert isinstance(value, int)
        return self._record("perConvReservedTiles", value)

    def cycleBackOff(self, value: float) -> MultiConv:
        assert isinstance(value, float)
        return self._record("cycleBackOff", value)

    def __enter__(self) -> MultiConv:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class NameScope:
    """Names the ops created inside it on an IPU; no effect on values."""

    def __init__(self, name: str) -> None:
        assert isinstance(name, str), "Parameter to NameScope must be a string"
        self.name = name

    def __enter__(self) -> NameScope:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
