"""``popxl.transforms``: ``popxl.transforms.autodiff`` in torch.

Follows popart ``python/popxl/python_files/transforms/autodiff.py``: the gradient graph's
expected inputs start with the gradients of ``grads_provided`` (default: every output of the
forward graph), in that order, followed by forward tensors it needs; its outputs are the
gradients of ``grads_required`` (default: every input), in that order. Here the forward
tensors it needs are all the forward graph's inputs: the gradient graph recomputes the
forward graph with torch autograd, where PopART would stitch stored activations instead.
"""
from __future__ import annotations

from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _core as _r
from ._core import Run, Tensor, add_stateful_op, graph_input
from ._ops import CallSiteInfo

__all__ = ["autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType"]


def __dir__() -> List[str]:  # only what PopXL has here
    return sorted(__all__)

# PopART has no gradient for these: Pow2ScaleThenCastOp::getGradOps and a pow2-scaled
# MatMulOp::getGradOps throw (willow/src/op/pow2scalethencast.cpp, willow/src/op/matmul.cpp);
# the package's own FP8 custom op (popxl/codelets.py) has no grad op either.
_NOT_DIFFERENTIABLE = ("pow2scale_cast_to_fp8", "matmul_pow2scaled", "fp8_amax_cast")


class ExpectedConnectionType(Enum):
    Fwd = "Fwd"
    FwdGrad = "FwdGrad"


class ExpectedConnection:
    def __init__(self, fwd_tensor: Tensor, connection_type: ExpectedConnectionType):
        self.fwd_tensor = fwd_tensor
        self.connection_type = connection_type

    def __repr__(self) -> str:
        return f"({self.connection_type}, {self.fwd_tensor})"


class GradGraphInfo:
    """autodiff.py ``GradGraphInfo``."""

    def __init__(self, graph: _r.Graph, forward_graph: _r.Graph,
                 expected_inputs: Sequence[ExpectedConnection], required: Sequence[Tensor]):
        self.graph = graph
        self.forward_graph = forward_graph
        self.expected_inputs = tuple(expected_inputs)
        self.expected_outputs = tuple(
            ExpectedConnection(t, ExpectedConnectionType.FwdGrad) for t in required)

    @property
    def inputs(self) -> Tuple[Tensor, ...]:
        return tuple(c.fwd_tensor for c in self.expected_inputs)

    @property
    def outputs(self) -> Tuple[Tensor, ...]:
        return tuple(c.fwd_tensor for c in self.expected_outputs)

    def inputs_dict(self, fwd_call_info: CallSiteInfo) -> Dict[Tensor, Tensor]:
        """Gradient-graph inputs that are forward tensors, mapped to the parent tensors of
        one call of the forward graph."""
        if fwd_call_info.called_graph is not self.forward_graph:
            raise TypeError("The called graph does not match the graph that was differentiated.")
        return {
            self.graph.inputs[index]: fwd_call_info.graph_to_parent(connection.fwd_tensor)
            for index, connection in enumerate(self.expected_inputs)
            if connection.connection_type is ExpectedConnectionType.Fwd
        }

    def fwd_graph_ins_to_grad_parent_outs(self, grad_call_info: CallSiteInfo
                                          ) -> Dict[Tensor, Tensor]:
        """Forward-graph inputs whose gradients the gradient graph gives, mapped to the
        parent tensors of one call of the gradient graph."""
        return {t: grad_call_info.graph_to_parent(self.graph.outputs[index])
                for index, t in enumerate(self.outputs)}

    def fwd_parent_ins_to_grad_parent_outs(self, fwd_call_info: CallSiteInfo,
                                           grad_call_info: CallSiteInfo) -> Dict[Tensor, Tensor]:
        return {
            fwd_call_info.graph_to_parent(t): grad_call_info.graph_to_parent(
                self.graph.outputs[index])
            for index, t in enumerate(self.outputs)
        }


def autodiff(graph: _r.Graph, grads_provided: Optional[Sequence[Tensor]] = None,
             grads_required: Optional[Sequence[Tensor]] = None) -> GradGraphInfo:
    """The gradient graph of ``graph`` (see the module docstring)."""
    for op in graph._ops:
        if op.name in _NOT_DIFFERENTIABLE:
            raise RuntimeError(
                f"Floating point 8 is not supported for training (op {op.name} in {graph}); "
                "write its gradient by hand")
    provided = list(graph.outputs if grads_provided is None else grads_provided)
    required = list(graph.inputs if grads_required is None else grads_required)
    for t in provided:
        if t not in graph.outputs:
            raise ValueError(f"grads_provided: {t} is not an output of {graph}")
    for t in required:
        if t not in graph.inputs or not t.dtype.torch_dtype.is_floating_point:
            raise ValueError(f"grads_required: {t} is not a float input of {graph}")
    forward_inputs = list(graph.inputs)

    grad_graph = _r.Graph(graph.ir, f"{graph.name}.grad")
    with grad_graph:
        for t in provided:
            graph_input(grad_graph, t, "grad")
        for t in forward_inputs:
            graph_input(grad_graph, t, "fwd")

        def differentiate(state: Run, *values: torch.Tensor) -> Tuple[torch.Tensor, ...]:
            output_grads, input_values = values[:len(provided)], values[len(provided):]
            leaves = [value.detach().requires_grad_(t in required)
                      for t, value in zip(forward_inputs, input_values)]
            with torch.enable_grad():
                outputs = graph._run(Run(state.variables, {}, None), leaves)
            pairs = [(outputs[graph.outputs.index(t)], g) for t, g in zip(provided, output_grads)]
            pairs = [(out, g) for out, g in pairs if out.requires_grad]
            wrt = [leaves[forward_inputs.index(t)] for t in required]
            grads: List[Optional[torch.Tensor]] = [None] * len(wrt)
            if pairs:
                grads = list(torch.autograd.grad([o for o, _ in pairs], wrt,
                                                 grad_outputs=[g for _, g in pairs],
                                                 allow_unused=True))
            return tuple(torch.zeros_like(w) if g is None else g.detach()
                         for w, g in zip(wrt, grads))

        outputs = add_stateful_op("autodiff", differentiate, grad_graph.inputs,
                                   [(t.shape, t.dtype) for t in required])
        grad_graph._outputs.extend(outputs)
    expected = [ExpectedConnection(t, ExpectedConnectionType.FwdGrad) for t in provided]
    expected += [ExpectedConnection(t, ExpectedConnectionType.Fwd) for t in forward_inputs]
    return GradGraphInfo(grad_graph, graph, expected, required)
