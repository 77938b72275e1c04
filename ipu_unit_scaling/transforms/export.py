"""The second tracer of `unit_scale`: `torch.export`, for models torch.fx cannot trace.

torch.fx runs a model's Python code on proxies, so code that needs a number where it has a
proxy fails: Hugging Face BERT slices a position buffer by the input's length
(`position_ids[:, :seq_length]`), which fx turns into a `TypeError`. `torch.export` (non-strict)
runs the same code on fake tensors whose shapes are concrete (or symbolic integers), so such code
just runs, and records the ATen ops it reaches. Two steps bring that graph to the form the
rewrite of `unit_scale` works on:

- every leaf module (one `unit_scale` converts, skips or leaves as a unit) whose ops form a
  region with one tensor input and one output is folded back into one `call_module` node
  ("outlined", using the module stack export records for each op), so module conversions,
  `skip=` and `replacements=` work as with fx;
- the ATen ops left have adapters here (`aten.linear`, `aten.scaled_dot_product_attention`,
  `aten.cross_entropy_loss`, ...) that call the unit-scaled ops.

Export needs torch >= 2.5 (non-strict export to the training IR, which keeps `linear`,
`layer_norm` and `scaled_dot_product_attention` whole). Shapes are exported as dynamic
(`Dim.AUTO`) where the model allows; dimensions export had to fix are checked on every call.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor, nn

from . import replacements as R
from .fx_tracing import ArgumentFrame, Inputs

__all__ = ["export_unavailable", "ExportTrace", "trace_with_export", "ATEN_ADAPTERS",
           "ATEN_WEIGHT_POSITIONS", "module_path"]

_MINIMUM = (2, 5)


def _torch_version() -> Tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def export_unavailable() -> Optional[str]:
    """Why the torch.export tracer cannot run here, or None when it can."""
    if _torch_version() < _MINIMUM or not hasattr(torch, "export"):
        return (f"the torch.export tracer needs torch >= {_MINIMUM[0]}.{_MINIMUM[1]} (non-strict "
                f"export to the training IR); this is torch {torch.__version__}")
    return None


@dataclass
class ExportTrace:
    """An exported call, ready for the rewrite: the frame (root), its graph and what the
    rewrite needs to know about it."""

    root: ArgumentFrame
    graph: fx.Graph
    tensor_nodes: Set[str]
    # Per tensor argument: each dimension's fixed size, or None where it stayed dynamic.
    fixed_shapes: List[Tuple[Optional[int], ...]]
    # Attributes the graph's code reads from its module (the pytree specs).
    attributes: Dict[str, Any] = field(default_factory=dict)
    outlined: List[str] = field(default_factory=list)
    dynamic: bool = True


def _export(frame: ArgumentFrame, dynamic: bool) -> Any:
    tensors = tuple(frame.example_tensors)
    shapes = None
    if dynamic:
        auto = torch.export.Dim.AUTO  # type: ignore[attr-defined]
        shapes = (tuple({i: auto for i in range(t.dim())} for t in tensors),)
    return torch.export.export(frame, tensors, dynamic_shapes=shapes,  # type: ignore[attr-defined]
                               strict=False)


def trace_with_export(
    module: nn.Module, inputs: Inputs, is_leaf: Callable[[nn.Module, str], bool]
) -> ExportTrace:
    """Export `module(*args, **kwargs)` through an `ArgumentFrame` and outline its leaf modules.

    `is_leaf(module, name)` takes names relative to `module`. Raises whatever export raises.
    """
    reason = export_unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    frame = ArgumentFrame(module, inputs)
    dynamic = True
    try:
        program = _export(frame, dynamic=True)
    except Exception:  # some models pin a size (a mask built for one length): export as is
        dynamic = False
        program = _export(frame, dynamic=False)
    unlifted = program.module()
    graph = unlifted.graph
    attributes = {name: getattr(unlifted, name) for name in ("_in_spec", "_out_spec")
                  if hasattr(unlifted, name)}
    assert_metadata = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    for node in list(graph.nodes):
        if node.op == "call_module":  # export's own input guards: the frame will run them
            frame.add_module(str(node.target), unlifted.get_submodule(str(node.target)))
        elif node.op == "get_attr" and "." not in str(node.target) and isinstance(
                getattr(unlifted, str(node.target), None), nn.Module):
            # The body of a higher-order op (a `with torch.autocast(...)` block, say): the
            # frame, which runs the graph, holds it as export's module did.
            frame.add_module(str(node.target), getattr(unlifted, str(node.target)))
        elif node.op == "call_function" and not node.users and assert_metadata is not None \
                and getattr(node.target, "overloadpacket", None) is assert_metadata:
            # Export's checks that a `.to()` saw the dtype of the example: PopTorch has no
            # handler for them, and the converted model runs on the example's dtypes.
            graph.erase_node(node)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fixed = [tuple(d if isinstance(d, int) else None for d in n.meta["val"].shape)
             for n in placeholders if isinstance(n.meta.get("val"), Tensor)]
    trace = ExportTrace(frame, graph, set(), fixed, attributes, dynamic=dynamic)
    trace.outlined = _outline_leaves(trace, is_leaf)
    trace.tensor_nodes = _floating_nodes(graph, frame)
    return trace  # checked (lint) once the frame owns it, in the rewrite


def _floating_nodes(graph: fx.Graph, root: nn.Module) -> Set[str]:
    names = set()
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "get_attr":
            value = _get_attr(root, str(node.target))
        leaves = pytree.tree_flatten(value)[0]
        if any(isinstance(leaf, Tensor) and leaf.is_floating_point() for leaf in leaves):
            names.add(node.name)
    return names


def _get_attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def module_path(node: fx.Node) -> str:
    """The qualified name (below the frame) of the innermost module a node's op ran in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path[len("inner."):] if path.startswith("inner.") else ("" if path == "inner" else path)


# ---------------------------------------------------------------- outlining


def _outline_leaves(trace: ExportTrace, is_leaf: Callable[[nn.Module, str], bool]) -> List[str]:
    """Fold each leaf module's ops back into one call_module node where the region allows."""
    graph, frame = trace.graph, trace.root
    regions: Dict[str, List[fx.Node]] = {}
    paths: Dict[str, str] = {}
    for node in graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            regions.setdefault(key, []).append(node)
            paths[key] = path
    outlined: List[str] = []
    done: List[str] = []
    for key, nodes in regions.items():
        path = paths[key]
        if not path.startswith("inner.") or any(path.startswith(p + ".") for p in done):
            continue
        try:
            module = frame.get_submodule(path)
        except AttributeError:  # a module created inside forward, not registered
            continue
        name = path[len("inner."):]
        if not is_leaf(module, name):
            continue
        if _outline(graph, frame, path, module, nodes):
            outlined.append(name)
            done.append(path)
    return outlined


def _returns_its_input(node: fx.Node) -> bool:
    """A `.to()` to the dtype and device its input already has, which returns the input itself.

    Export records it as a node, and code after it that reads the same tensor (the residual
    that RMSNorm's `hidden_states.to(torch.float32)` reads in Llama's layers) reads that node.
    """
    if getattr(node.target, "overloadpacket", None) is not torch.ops.aten.to or node.kwargs.get(
            "copy") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    value, source = node.meta.get("val"), node.args[0].meta.get("val")
    return (isinstance(value, Tensor) and isinstance(source, Tensor)
            and value.dtype == source.dtype and value.device == source.device)


def _outline(graph: fx.Graph, frame: nn.Module, path: str, module: nn.Module,
             nodes: List[fx.Node]) -> bool:
    region = set(nodes)
    for node in nodes:  # a read of the region's input outside it reads the input
        source = node.args[0] if _returns_its_input(node) else None
        if isinstance(source, fx.Node) and source not in region:
            for user in [u for u in node.users if u not in region]:
                user.replace_input_with(node, source)
    own = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}

    def is_own_state(node: fx.Node) -> bool:  # get_attr targets are named from the frame
        return node.op == "get_attr" and id(_get_attr(frame, str(node.target))) in own

    inputs: List[fx.Node] = []
    for node in nodes:
        for source in node.all_input_nodes:
            if source not in region and not is_own_state(source) and source not in inputs:
                inputs.append(source)
    outputs = [n for n in nodes if any(user not in region for user in n.users)]
    tensor_inputs = [n for n in inputs if isinstance(n.meta.get("val"), Tensor)]
    if len(outputs) != 1 or len(tensor_inputs) != 1 or len(inputs) != 1:
        return False
    (output,) = outputs
    if not isinstance(output.meta.get("val"), Tensor):
        return False
    with graph.inserting_after(output):
        # create_node: the graph's owner (export's module) lacks parameter-free modules; the
        # frame, which becomes the owner, has them all.
        call = graph.create_node("call_module", path, (tensor_inputs[0],), {})
    call.meta = {"val": output.meta.get("val"), "nn_module_stack": output.meta.get(
        "nn_module_stack", {})}
    for user in list(output.users):
        if user is not call and user not in region:
            user.replace_input_with(output, call)
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)
    return True


# ---------------------------------------------------------------- ATen adapters
# Each takes exactly the ATen op's arguments and calls the unit-scaled op.

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def aten_embedding(weight: Tensor, indices: Tensor, padding_idx: int = -1,
                   scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    return R.unit_embedding(indices, weight, None if padding_idx < 0 else padding_idx, None,
                            2.0, scale_grad_by_freq, sparse)


def aten_layer_norm(input: Tensor, normalized_shape: Sequence[int],
                    weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                    eps: float = 1e-5, cudnn_enable: bool = True) -> Tensor:
    return R.unit_layer_norm(input, normalized_shape, weight, bias, eps)


def aten_softmax(input: Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    return R.unit_softmax(input, dim, dtype=dtype)


def aten_private_softmax(input: Tensor, dim: int, half_to_float: bool) -> Tensor:
    return R.unit_softmax(input, dim, dtype=torch.float32 if half_to_float else None)


def aten_cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                       reduction: int = 1, ignore_index: int = -100,
                       label_smoothing: float = 0.0) -> Tensor:
    return R.unit_cross_entropy(input, target, weight, ignore_index=ignore_index,
                                reduction=_REDUCTIONS[reduction], label_smoothing=label_smoothing)


def aten_mse_loss(input: Tensor, target: Tensor, reduction: int = 1) -> Tensor:
    return R.unit_mse_loss(input, target, reduction=_REDUCTIONS[reduction])


def aten_rms_norm(input: Tensor, normalized_shape: Sequence[int],
                  weight: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
    return R.unit_rms_norm(input, normalized_shape, weight, eps)


def _aten(name: str, overload: str = "default") -> Any:
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


def _aten_adapters() -> Dict[Any, Callable[..., Tensor]]:
    table: Dict[Tuple[str, str], Callable[..., Tensor]] = {
        ("linear", "default"): R.unit_linear,
        ("matmul", "default"): R.unit_matmul,
        ("bmm", "default"): R.unit_matmul,
        ("addmm", "default"): R.unit_addmm,
        ("gelu", "default"): R.unit_gelu,
        ("relu", "default"): R.unit_relu,
        ("silu", "default"): R.unit_silu,
        ("softmax", "int"): aten_softmax,
        ("_softmax", "default"): aten_private_softmax,
        ("layer_norm", "default"): aten_layer_norm,
        ("rms_norm", "default"): aten_rms_norm,
        ("embedding", "default"): aten_embedding,
        ("scaled_dot_product_attention", "default"): R.unit_scaled_dot_product_attention,
        ("cross_entropy_loss", "default"): aten_cross_entropy,
        ("mse_loss", "default"): aten_mse_loss,
    }
    found: Dict[Any, Callable[..., Tensor]] = {}
    for (name, overload), adapter in table.items():
        op = _aten(name, overload)
        if op is not None:
            found[op] = adapter
    return found


ATEN_ADAPTERS: Dict[Any, Callable[..., Tensor]] = _aten_adapters()
# Where adapters read a weight (and bias) straight from an attribute: (weight, bias) positions.
ATEN_WEIGHT_POSITIONS = {aten_embedding: (0, None)}

ATEN_ADD = {op for op in (_aten("add", "Tensor"),) if op is not None}
ATEN_SUB = {op for op in (_aten("sub", "Tensor"),) if op is not None}
ATEN_MUL = {op for op in (_aten("mul", "Tensor"),) if op is not None}
ATEN_DROPOUT = {op for op in (_aten("dropout"),) if op is not None}
ATEN_SILU = {op for op in (_aten("silu"),) if op is not None}
ATEN_ATTENTION = {op for op in (_aten("scaled_dot_product_attention"), _aten("softmax", "int"),
                                _aten("_softmax")) if op is not None}

# Ops that only move, view, index or retype elements, as overload packets.
_SHAPE_PACKETS = (
    "view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze",
    "slice", "select", "contiguous", "clone", "to", "_to_copy", "detach", "alias", "flatten",
    "unflatten", "split", "split_with_sizes", "chunk", "cat", "stack", "t", "arange", "zeros",
    "ones", "full", "new_ones", "new_zeros", "new_empty", "empty", "zeros_like", "ones_like",
    "full_like", "_assert_tensor_metadata", "sym_size", "lift_fresh_copy", "masked_fill",
    "tril", "triu", "eq", "ne", "lt", "le", "gt", "ge", "index", "gather", "type_as",
)
ATEN_SHAPE_PACKETS = {getattr(torch.ops.aten, name) for name in _SHAPE_PACKETS
                      if hasattr(torch.ops.aten, name)}


def is_aten_shape_op(target: Any) -> bool:
    packet = getattr(target, "overloadpacket", None)
    return packet is not None and packet in ATEN_SHAPE_PACKETS or target is operator.getitem
