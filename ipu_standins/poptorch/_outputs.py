"""What a call of a PopTorch model returns besides running: its outputs by output mode, and the
tensors anchored with ``Options.anchorTensor``.

A call runs ``deviceIterations x gradientAccumulation x replicas`` micro-batches (in that
order). The output mode picks from the per-micro-batch values: All (every micro-batch's),
Final (the last iteration's), Sum (summed over iterations) or EveryN (every N-th iteration's).
The model's outputs are batched, so All concatenates them on the batch dimension; an anchored
tensor is not, so All stacks its values on new leading dimensions, one for each of device
iterations, accumulation and replicas that is over 1 (the shape of a PopART anchor).

Anchors name tensors of the compiled graph (PopART's names, :class:`TensorNames`): the inputs
(``input``, ``input/1``...), the parameters (``fc1.weight``), every op's output, named after the
module that made it and the ATen op (``fc1/addmm:0``; a repeat gets ``/1``, ``/2``...), and for
training the gradients (``Gradient___fc1.weight``, per micro-batch, carrying the loss scaling as
PopART's do), the updated weights (``UpdatedVar___fc1.weight``, per iteration) and, for SGD
without momentum, PopART's SGD0 scalars (``scaledLearningRate0___default___FLOAT``: ``lr (1 -
dampening) / loss_scaling``; ``weightDecayScaleFactor0___default___FLOAT``: ``1 - lr (1 -
dampening) weight_decay``; a second group's are ``___specific___<its first parameter>``);
with automatic loss scaling, ``finalLossScale``: the optimizer's loss scaling after each step.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx

from . import enums
from ._impl import createPoptorchError
from ._tracer import SCOPE_META

__all__ = ["choose_outputs", "TensorNames", "tensor_names", "AnchorRecorder", "GRADIENT",
           "UPDATED", "FINAL_LOSS_SCALE", "ipu_dtype", "no_backward"]

GRADIENT = "Gradient___"
UPDATED = "UpdatedVar___"
FINAL_LOSS_SCALE = "finalLossScale"


def _join(values: List[Any]) -> Any:
    first = values[0]
    if len(values) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.stack(values) if first.dim() == 0 else torch.cat(values)
    return first


def _sum(values: List[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        total = values[0].clone()
        for value in values[1:]:
            total = total + value
        return total.to(first.dtype)
    return first


def _combine(outputs: List[Any], how: Any) -> Any:
    """Combine each leaf of the per-micro-batch output structures with ``how``."""
    first = outputs[0]
    if isinstance(first, torch.Tensor) or first is None:
        return how(outputs) if first is not None else None
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_combine(list(p), how) for p in zip(*outputs)))
    if isinstance(first, (tuple, list)):
        return type(first)(_combine(list(p), how) for p in zip(*outputs))
    if isinstance(first, dict):
        joined = type(first)() if type(first) is not dict else {}
        for key in first:
            joined[key] = _combine([o[key] for o in outputs], how)
        return joined
    return first


def choose_outputs(outputs: List[Any], options: Any) -> Any:
    """The model's outputs a call returns, from every micro-batch's (module doc)."""
    mode = enums.OutputMode(options.output_mode)
    replicas = options.replication_factor // options.input_group_size
    per_iteration = len(outputs) // options.device_iterations
    if mode == enums.OutputMode.All:
        return _combine(outputs, _join)
    if mode == enums.OutputMode.Final:
        last = outputs[-replicas:]
        return last[0] if replicas == 1 else _combine(last, _join)
    if mode == enums.OutputMode.Sum:
        by_replica = [_combine(outputs[r::replicas], _sum) for r in range(replicas)]
        return by_replica[0] if replicas == 1 else _combine(by_replica, _join)
    period = options.output_return_period
    chosen = [o for i in range(period - 1, options.device_iterations, period)
              for o in outputs[i * per_iteration:(i + 1) * per_iteration]]
    return _combine(chosen, _join) if chosen else None


def _stack(values: List[torch.Tensor], leading: Tuple[int, ...]) -> torch.Tensor:
    if len(values) == 1:
        return values[0]
    shape = [d for d in leading if d > 1]
    return torch.stack(values).reshape(*shape, *values[0].shape)


def choose_anchor(values: List[torch.Tensor], mode: enums.OutputMode, period: int,
                  iterations: int, replicas: int) -> Optional[torch.Tensor]:
    """An anchored tensor's value after a call, from its value at each micro-batch (or each
    iteration: then ``replicas`` is 1), by output mode (module doc)."""
    per_iteration = len(values) // iterations
    accumulation = per_iteration // replicas
    if mode == enums.OutputMode.All:
        return _stack(values, (iterations, accumulation, replicas))
    if mode == enums.OutputMode.Final:
        return _stack(values[-replicas:], (replicas,))
    if mode == enums.OutputMode.Sum:
        return _stack([_sum(values[r::replicas]) for r in range(replicas)], (replicas,))
    chosen = list(range(period - 1, iterations, period))
    if not chosen:
        return None
    picked = [v for i in chosen for v in values[i * per_iteration:(i + 1) * per_iteration]]
    return _stack(picked, (len(chosen), accumulation, replicas))


class TensorNames:
    """The names of a compiled graph's tensors (module doc) and where each one's value is."""

    def __init__(self, graph: fx.GraphModule, inputs: int, parameter_names: List[str],
                 trained: List[str], optimizer: Optional[torch.optim.Optimizer],
                 names_by_id: Dict[int, str], prefix: str = "model.",
                 loss_scaling: bool = False):
        """``parameter_names`` as the user's model names them; ``trained``: those the
        optimizer updates; ``names_by_id``: the optimizer's parameters' names, by ``id``;
        ``prefix``: the user's model's path in the traced module; ``loss_scaling``: whether
        automatic loss scaling names the loss scale after each step (``finalLossScale``)."""
        self.inputs = ["input" if i == 0 else f"input/{i}" for i in range(inputs)]
        self.parameters = list(parameter_names)
        self.nodes: Dict[str, str] = {}  # tensor name -> graph node
        seen: Dict[str, int] = collections.Counter()
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            packet = getattr(node.target, "overloadpacket", None)
            op = packet.__name__ if packet is not None else getattr(
                node.target, "__name__", str(node.target))
            scope = str(node.meta.get(SCOPE_META, ""))
            scope = scope[len(prefix):].replace(".", "/") if scope.startswith(prefix) else ""
            base = f"{scope}/{op}:0" if scope else f"{op}:0"
            seen[base] += 1
            self.nodes[base if seen[base] == 1 else f"{base}/{seen[base] - 1}"] = node.name
        self.trained = list(trained)
        self.scalars = _sgd0_scalars(optimizer, names_by_id) if optimizer else {}
        self.per_step = [FINAL_LOSS_SCALE] if loss_scaling and optimizer else []

    def all(self) -> List[str]:
        return [*self.inputs, *self.parameters, *self.nodes,
                *(GRADIENT + n for n in self.trained), *(UPDATED + n for n in self.trained),
                *self.scalars, *self.per_step]


def tensor_names(graph: Any, inputs: int, optimizer: Optional[torch.optim.Optimizer],
                 anchors: Dict[str, List[Any]], loss_scaling: bool = False,
                 prefix: str = "model.") -> TensorNames:
    """The tensor names of a compiled graph (``_compile.CompiledGraph``; ``optimizer`` for
    training); refuses an anchor that names none of them."""
    names = [n[len(prefix):] for n in graph.trace.parameter_names]
    trained = [n for n, p in zip(names, graph.parameters) if p.requires_grad and optimizer]
    by_id = {id(p): n for n, p in zip(names, graph.parameters)}
    found = TensorNames(graph.trace.graph, inputs, names, trained, optimizer, by_id, prefix,
                        loss_scaling)
    known = set(found.all())
    for short, anchor in anchors.items():
        if anchor[0] not in known:
            raise createPoptorchError(
                f"Anchored tensor '{anchor[0]}' (short name '{short}') is not a tensor of the "
                "graph: getTensorNames() lists them")
    return found


def _sgd0_scalars(optimizer: torch.optim.Optimizer, names_by_id: Dict[int, str]
                  ) -> Dict[str, torch.Tensor]:
    if not isinstance(optimizer, torch.optim.SGD):
        return {}
    scalars = {}
    loss_scaling = float(getattr(optimizer, "loss_scaling", None) or 1.0)
    for index, group in enumerate(optimizer.param_groups):
        if group.get("momentum", 0.0) != 0.0:
            continue
        first = names_by_id.get(id(group["params"][0]), str(index)) if group["params"] else ""
        suffix = "___default___FLOAT" if index == 0 else f"___specific___{first}"
        rate = group["lr"] * (1.0 - group.get("dampening", 0.0))
        scalars["scaledLearningRate0" + suffix] = torch.tensor(rate / loss_scaling)
        scalars["weightDecayScaleFactor0" + suffix] = torch.tensor(
            1.0 - rate * group.get("weight_decay", 0.0))
    return scalars


class AnchorRecorder:
    """Collects the anchored tensors' values during one call."""

    def __init__(self, names: TensorNames, anchors: Dict[str, List[Any]]):
        self.names = names
        self.anchors = anchors  # short name -> [long name, default mode, mode, period]
        wanted = {a[0] for a in anchors.values()}
        self.nodes = {names.nodes[n] for n in wanted if n in names.nodes}
        self.values: Dict[str, List[torch.Tensor]] = collections.defaultdict(list)
        self.wanted = wanted

    def micro_batch(self, inputs: List[torch.Tensor], parameters: List[torch.Tensor],
                    captured: Dict[str, torch.Tensor]) -> None:
        for name, tensor in [*zip(self.names.inputs, inputs),
                             *zip(self.names.parameters, parameters)]:
            if name in self.wanted:
                self.values[name].append(tensor.detach().clone())
        for name, node in self.names.nodes.items():
            if name in self.wanted and node in captured:
                self.values[name].append(captured[node])

    def gradients(self, gradients: Dict[str, torch.Tensor]) -> None:
        for name, gradient in gradients.items():
            if GRADIENT + name in self.wanted:
                self.values[GRADIENT + name].append(gradient)

    def wants_gradients(self) -> bool:
        return any(n.startswith(GRADIENT) for n in self.wanted)

    def step(self, parameters: Dict[str, torch.Tensor], optimizer: Any,
             names_by_id: Dict[int, str]) -> None:
        """After an optimizer step: the updated weights, the optimizer's scalars."""
        for name, parameter in parameters.items():
            if UPDATED + name in self.wanted:
                self.values[UPDATED + name].append(parameter.detach().clone())
        if FINAL_LOSS_SCALE in self.wanted and self.names.per_step:
            # the scale the step's backward pass started from: the loss scaling times
            # automatic loss scaling's factor
            scale = optimizer.final_loss_scale() if hasattr(optimizer, "final_loss_scale") \
                else float(getattr(optimizer, "loss_scaling", None) or 1.0)
            self.values[FINAL_LOSS_SCALE].append(torch.tensor(scale, dtype=torch.float32))
        if optimizer is not None and any(n in self.wanted for n in self.names.scalars):
            for name, value in _sgd0_scalars(optimizer, names_by_id).items():
                if name in self.wanted:
                    self.values[name].append(value)

    def results(self, options: Any) -> Dict[str, torch.Tensor]:
        iterations = options.device_iterations
        replicas = options.replication_factor // options.input_group_size
        out = {}
        for short, (long, default, mode, period) in self.anchors.items():
            values = self.values.get(long)
            if not values:
                continue
            if default:
                mode, period = options.output_mode, options.output_return_period
            per_step = long.startswith(UPDATED) or long in self.names.scalars or (
                long in self.names.per_step)
            chosen = choose_anchor(values, enums.OutputMode(mode), int(period or 1), iterations,
                                   1 if per_step else replicas)
            if chosen is not None:
                out[short] = chosen
        return out


def no_backward(*args: Any, **kwargs: Any) -> None:
    raise createPoptorchError(
        "backward() cannot be called explicitly on outputs of a PopTorch model. If you're "
        "using a trainingModel, the backwards pass is performed automatically when invoking "
        "the model. If you're using an inferenceModel, you should use a trainingModel "
        "instead.")


def ipu_dtype(value: Any) -> Any:
    """An output as the IPU returns it: no 64-bit types (int64 as int32, float64 as float32)."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.int64:
            return value.to(torch.int32)
        if value.dtype == torch.float64:
            return value.to(torch.float32)
    return value
