"""`track_scales(module)`: a copy of a module that records, on its captured forward graph, the
statistics of every floating-point tensor and of its gradient (unit_scaling's contract).

After a forward (and backward) pass, `module.scales_graph()` is the torch.fx graph of the last
captured forward (see `compose`), where each node that produced a floating-point tensor carries
`node.meta["metrics"]`, a `Metrics` with `fwd` (the tensor's) and `bwd` (its gradient's, once
the backward pass has run) statistics. `prune_non_float_tensors`, `prune_same_scale_tensors`
and `prune_selected_nodes` reduce such a graph to the tensors worth looking at.

Floating-point inputs of the transformed module are made to require gradients, so that their
gradients are recorded too. For a per-tensor table over one training step (roles, FP8 and FP16
range fractions), see :func:`ipu_unit_scaling.analysis.record_scales`.
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, TypeVar

import torch
from torch import Tensor, fx, nn

from .compose import apply_transform

__all__ = [
    "Metrics", "track_scales", "prune_non_float_tensors", "prune_same_scale_tensors",
    "prune_selected_nodes",
]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)


class Metrics:
    """Statistics of one tensor (`fwd`) and of its gradient (`bwd`, None until recorded)."""

    @dataclass
    class Data:
        """Statistics of one tensor."""

        mean_abs: float  # mean of |x|
        abs_mean: float  # |mean of x|
        std: float
        abs_max: float
        abs_min: float
        numel: int

    _FULL_NAMES = {
        "mean_abs": "mean absolute value", "abs_mean": "absolute mean value",
        "std": "standard deviation", "abs_max": "absolute maximum",
        "abs_min": "absolute minimum", "numel": "number of elements",
    }

    def __init__(self, fwd_tensor: Tensor) -> None:
        self.fwd = self.from_tensor(fwd_tensor)
        self.bwd: Optional[Metrics.Data] = None

    def set_bwd(self, bwd_tensor: Tensor) -> None:
        self.bwd = self.from_tensor(bwd_tensor)

    def __str__(self) -> str:
        return f"fwd: {self.fwd}, bwd: {self.bwd}"

    @staticmethod
    def from_tensor(t: Tensor) -> Metrics.Data:
        values = t.detach()
        magnitude = values.abs()
        empty = values.numel() == 0
        return Metrics.Data(
            mean_abs=math.nan if empty else magnitude.mean().item(),
            abs_mean=math.nan if empty else values.mean().abs().item(),
            std=values.std().item() if values.numel() > 1 else 0.0,
            abs_max=math.nan if empty else magnitude.max().item(),
            abs_min=math.nan if empty else magnitude.min().item(),
            numel=values.numel(),
        )

    @staticmethod
    def names() -> List[str]:
        return [f.name for f in fields(Metrics.Data)]

    @staticmethod
    def get_full_name(short_name: str) -> str:
        return Metrics._FULL_NAMES[short_name]

    @staticmethod
    def full_names() -> List[str]:
        return [Metrics.get_full_name(name) for name in Metrics.names()]


class _Record(torch.autograd.Function):
    """Identity (a copy) that records its input's metrics, and its gradient's."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, meta: Dict[str, Any]) -> Tensor:
        meta["metrics"] = Metrics(t)
        ctx.meta = meta
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        ctx.meta["metrics"].set_bwd(grad)
        return grad.clone(), None


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def _clean_name(name: str) -> str:
    """A graph node's name without TorchDynamo's local/global prefixes (`L_x_` -> `x`)."""
    for prefix in ("l__self___", "L__self___", "l_", "L_"):
        name = name.replace(prefix, "")
    return name.strip("_")


class _RecordingInterpreter(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        n.meta["clean_name"] = _clean_name(n.name)
        n.meta["outputs_float_tensor"] = _is_float_tensor(out)
        n.meta["requires_grad"] = isinstance(out, nn.Parameter) and out.requires_grad
        if n.meta["outputs_float_tensor"]:
            logger.info("adding tracking to node: %s", n)
            out = _Record.apply(out, n.meta)
        return out


class _RecordingBackend:
    def __init__(self) -> None:
        self.graph = fx.Graph()

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Tensor]) -> Callable[..., Any]:
        self.graph = gm.graph
        interpreter = _RecordingInterpreter(gm)
        return lambda *args: interpreter.run(*args)


class _InputsRequireGrad:
    """A forward that first makes the floating-point tensor arguments require gradients."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if _is_float_tensor(value) and value.is_leaf and not value.requires_grad:
                value.requires_grad_()
        return self.forward(*args, **kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> _InputsRequireGrad:
        return _InputsRequireGrad(copy.deepcopy(self.forward, memo))


def track_scales(module: M) -> M:
    """A copy of `module` that records tensor metrics on its captured graph, read with
    `module.scales_graph()` (see the module docstring). Apply it after other transforms."""
    backend = _RecordingBackend()
    tracked = apply_transform(module, backend)
    tracked.__dict__["forward"] = _InputsRequireGrad(tracked.__dict__["forward"])
    tracked.scales_graph = lambda: backend.graph  # type: ignore[assignment]
    return tracked


def _has_metrics(graph: fx.Graph) -> bool:
    return any("clean_name" in node.meta for node in graph.nodes)


def _float_args(node: fx.Node) -> List[fx.Node]:
    return [a for a in node.args
            if isinstance(a, fx.Node) and a.meta.get("outputs_float_tensor", False)]


def _prune(graph: fx.Graph, node: fx.Node, replacement: Optional[fx.Node] = None) -> None:
    """Remove `node`; its users take `replacement` (or None) in its place."""
    def swap(value: Any) -> Any:
        return replacement if value is node else value

    for user in list(node.users):
        user.args = fx.node.map_aggregate(user.args, swap)  # type: ignore[assignment]
        user.kwargs = fx.node.map_aggregate(user.kwargs, swap)  # type: ignore[assignment]
    graph.erase_node(node)


def prune_non_float_tensors(graph: fx.Graph) -> fx.Graph:
    """A copy of a `scales_graph()` without the nodes whose output is not a floating-point
    tensor (each user takes the pruned node's one floating-point input, if it had one)."""
    if not _has_metrics(graph):
        raise ValueError("prune_non_float_tensors needs a graph from track_scales' "
                         "module.scales_graph(), after a forward pass")
    graph = copy.deepcopy(graph)
    for node in list(graph.nodes):
        if node.op == "output" or node.meta.get("outputs_float_tensor", False):
            continue
        inputs = _float_args(node)
        logger.info("pruning non-float node: %s", node)
        _prune(graph, node, inputs[0] if len(inputs) == 1 else None)
    graph.lint()
    return graph


def _same_scale(a: Metrics, b: Metrics, rtol: float) -> bool:
    def close(x: Metrics.Data, y: Metrics.Data) -> bool:
        return math.isclose(x.mean_abs, y.mean_abs, rel_tol=rtol)

    if a.bwd is None or b.bwd is None:
        return a.bwd is None and b.bwd is None and close(a.fwd, b.fwd)
    return close(a.fwd, b.fwd) and close(a.bwd, b.bwd)


def prune_same_scale_tensors(graph: fx.Graph, rtol: float = 2**-16) -> fx.Graph:
    """A copy of a `scales_graph()` without the nodes that have one floating-point input and the
    same scale as it (mean absolute value within `rtol`, forward and backward): reshapes,
    views, copies. Nodes with several floating-point inputs are kept."""
    graph = copy.deepcopy(graph)
    for node in list(graph.nodes):
        if node.op == "output" or not node.meta.get("outputs_float_tensor", False):
            continue
        inputs = _float_args(node)
        if len(inputs) != 1 or "metrics" not in node.meta or "metrics" not in inputs[0].meta:
            continue
        if _same_scale(node.meta["metrics"], inputs[0].meta["metrics"], rtol):
            logger.info("pruning same-scale node: %s", node)
            _prune(graph, node, inputs[0])
    return graph


def prune_selected_nodes(graph: fx.Graph, targets: Iterable[Any]) -> fx.Graph:
    """`graph` (changed in place) without the nodes whose target is one of `targets`."""
    chosen = list(targets)
    for node in list(graph.nodes):
        if any(node.target is t or node.target == t for t in chosen):
            logger.info("pruning node: %s", node)
            _prune(graph, node)
    graph.lint()
    return graph
