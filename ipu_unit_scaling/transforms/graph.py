"""Graph helpers of `unit_scale`: what a node is, depends on and feeds."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx
from torch import Tensor, nn

from .. import modules as uu
from ..ops.scale_constraints import SharedInputGmean
from . import export as E
from . import replacements as R

_ATTENTION_MODULES = (nn.MultiheadAttention, R.UnitMultiheadAttention, uu.SelfAttention, nn.Softmax)


def share_input_scales(root: nn.Module, graph: fx.Graph) -> None:
    """Linears (unit-scaled, gmean) that read the same tensor: `SharedInputGmean` for each."""
    calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    for node in graph.nodes:
        readers: List[uu.Linear] = []
        for user in node.users:
            if user.op != "call_module" or calls[str(user.target)] != 1 or not user.args \
                    or user.args[0] is not node:
                continue
            module = root.get_submodule(str(user.target))
            if type(module) is uu.Linear and module.constraint == "gmean":
                readers.append(module)
        if len(readers) > 1:
            shared = SharedInputGmean(sum(m.out_features for m in readers))
            for module in readers:
                module.constraint = shared


def _attention_call(root: nn.Module, node: fx.Node) -> Optional[Tuple[Dict[str, Any], float]]:
    """A converted attention call's arguments by name, and its dropout; None for another node."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        if not isinstance(module, R.UnitAttention):
            return None
        given: Dict[str, Any] = dict(zip(names[:3], node.args))
        given.update(node.kwargs)
        return given, module.dropout_p
    if node.op != "call_function" or node.target is not R.unit_scaled_dot_product_attention:
        return None
    arguments: Dict[str, Any] = dict(zip(names, node.args))
    arguments.update(node.kwargs)
    return arguments, arguments.get("dropout_p", 0.0)


def mark_attention_projections(root: nn.Module, graph: fx.Graph) -> None:
    """Query, key and value projections: `uu.AttentionProjection`, the gradient rules that
    attention sets on their parameters (see `U.attention_query_key_grad_scale` and
    `U.attention_value_bias_grad_scale`).

    A `uu.Linear` called once, whose output reaches one argument (`query`, `key` or `value`) of
    one unit-scaled attention call through shape ops only (view, transpose, ...) and nowhere
    else; a value projection only with a bias (the values' rule is for the bias). The attention
    must have a known logit scale (the default, or `scale` with the head size known from the
    traced shapes) and a dropout, causal flag and scale that are constants of the graph. With
    grouped-query attention a key or value head serves G query heads and its gradients stay
    sqrt(G) above unit, as `U.scaled_dot_product_attention` keeps them.
    """
    calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    for node in graph.nodes:
        found = _attention_call(root, node)
        if found is None:
            continue
        arguments, dropout_p = found
        is_causal, scale = arguments.get("is_causal", False), arguments.get("scale")
        if any(isinstance(a, fx.Node) for a in (dropout_p, is_causal, scale)):
            continue
        logit_std = 1.0
        if scale is not None:
            meta = getattr(arguments.get("query"), "meta", {})
            value = meta.get("val")  # torch.export's; the fx tracer's is the example shape
            head_dim = value.shape[-1] if isinstance(value, Tensor) else (
                meta.get("example_shape") or (None,))[-1]
            if not isinstance(head_dim, int):
                continue
            logit_std = float(scale) * math.sqrt(head_dim)
        found_projections = {role: _single_projection(root, arguments.get(role), calls)
                             for role in ("query", "key", "value")}
        for role, (module, projection_input) in found_projections.items():
            if module is None or (role == "value" and module.bias is None):
                continue
            if role == "query" and (projection_input is None
                                    or projection_input is not found_projections["key"][1]):
                # The rule reads the key count from the projection's input length: right for
                # the keys and values, and for the queries only in self-attention.
                continue
            module.attention_projection = uu.AttentionProjection(
                role, float(dropout_p), bool(is_causal), logit_std)


def _single_projection(root: nn.Module, source: Any, calls: Dict[str, int]
                       ) -> Tuple[Optional[uu.Linear], Optional[fx.Node]]:
    """The `uu.Linear` (called once) whose output is `source` after shape ops that nothing else
    uses, and the node it reads; (None, None) if there is none."""
    while isinstance(source, fx.Node) and len(_value_users(source)) == 1 and source.args \
            and isinstance(source.args[0], fx.Node) and _is_shape_op(source):
        source = source.args[0]
    if not isinstance(source, fx.Node) or source.op != "call_module" \
            or len(_value_users(source)) != 1 or calls[str(source.target)] != 1:
        return None, None
    module = root.get_submodule(str(source.target))
    if type(module) is not uu.Linear or not source.args:
        return None, None
    projection_input = source.args[0]
    return module, projection_input if isinstance(projection_input, fx.Node) else None


def _value_users(node: fx.Node) -> List[fx.Node]:
    """The users of `node` that read its values, not only its shape (`x.shape`, `x.size()`,
    `x.dim()`, export's `sym_size`)."""
    sym_size = getattr(torch.ops.aten, "sym_size", None)

    def reads_shape_only(user: fx.Node) -> bool:
        if user.op == "call_function" and user.target is getattr:
            return len(user.args) > 1 and user.args[1] in ("shape", "ndim", "dtype", "device")
        if user.op == "call_method":
            return user.target in ("size", "dim")
        return user.op == "call_function" and sym_size is not None and \
            getattr(user.target, "overloadpacket", None) is sym_size

    return [user for user in node.users if not reads_shape_only(user)]


def _is_shape_op(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and hashable(node.target) and (
        node.target in R.SHAPE_TARGETS or E.is_aten_shape_op(node.target))


def first_line(error: BaseException) -> str:
    """The first line of an error's message (at most 120 characters), or its type's name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:120]


def silu_input(root: nn.Module, node: fx.Node) -> Optional[fx.Node]:
    """The input of a SiLU node (function, method or module call), else None."""
    if node.op == "call_module":
        is_silu = R.is_silu_module(root.get_submodule(str(node.target)))
    else:
        is_silu = node.op in ("call_function", "call_method") and hashable(node.target) and (
            node.target in R.SILU_TARGETS or node.target in E.ATEN_SILU
        )
    if not is_silu:
        return None
    source = node.args[0] if node.args else node.kwargs.get("input")
    return source if isinstance(source, fx.Node) else None


def gradient_nodes(
    root: nn.Module, graph: fx.Graph, is_tensor: Callable[[fx.Node], bool]
) -> Set[fx.Node]:
    """Float tensors that depend, through float tensors, on a parameter or a float input.

    Everything else (positions, masks, rotary tables from a buffer) carries no gradient and so
    no scale that unit scaling would have to keep.
    """
    found: Set[fx.Node] = set()
    for node in graph.nodes:
        if not is_tensor(node):
            continue
        if node.op == "placeholder":
            found.add(node)
        elif node.op == "get_attr":
            if isinstance(read_attribute(root, str(node.target)), nn.Parameter):
                found.add(node)
        elif node.op == "call_module" and next(
                root.get_submodule(str(node.target)).parameters(), None) is not None:
            found.add(node)
        elif any(n in found for n in node.all_input_nodes):
            found.add(node)
    return found


def hashable(target: Any) -> bool:
    """Can `target` be looked up in a dict or set (a node target that is, say, a list cannot)?"""
    try:
        hash(target)
    except TypeError:
        return False
    return True


def target_name(target: Any) -> str:
    """A node target's name: the string itself, or the callable's `__name__`."""
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def has_tensor_input(node: fx.Node, is_tensor: Callable[[fx.Node], bool]) -> bool:
    """Does `node` read any node that `is_tensor` accepts?"""
    return any(is_tensor(n) for n in node.all_input_nodes)


def read_attribute(root: nn.Module, target: str) -> Any:
    """The attribute a `get_attr` node reads: `target`, dotted, from `root`."""
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def set_submodule(root: nn.Module, target: str, module: nn.Module) -> None:
    """Put `module` at the dotted path `target` of `root`."""
    parent_name, _, child = target.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def node_order(graph: fx.Graph) -> Callable[[fx.Node], int]:
    """A function giving each node of `graph` its position in the graph's order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]


def _ancestors(
    node: fx.Node, follow: Optional[Callable[[fx.Node], bool]] = None
) -> Set[fx.Node]:
    """Nodes `node` depends on; with `follow`, only through nodes it accepts (tensor data)."""
    seen: Set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen and (follow is None or follow(current)):
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _descendants(node: fx.Node) -> Set[fx.Node]:
    seen: Set[fx.Node] = set()
    stack = list(node.users)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.users)
    return seen


def nodes_between(start: fx.Node, end: fx.Node) -> Set[fx.Node]:
    """Nodes on some path from `start` to `end`, both excluded."""
    return (_descendants(start) & _ancestors(end)) - {start, end}


def residual_operands(
    left: fx.Node, right: fx.Node, is_tensor: Callable[[fx.Node], bool]
) -> tuple[Optional[fx.Node], Optional[fx.Node]]:
    """(skip, branch) when one operand's data feeds the other, else (None, None).

    Only tensor data counts: a branch that merely reads the other's shape or device (position
    ids from the batch's length) is not a residual.
    """
    if left in _ancestors(right, is_tensor):
        return left, right
    if right in _ancestors(left, is_tensor):
        return right, left
    return None, None


def learned_nodes(root: nn.Module, graph: fx.Graph) -> Set[fx.Node]:
    """Nodes whose value depends on a parameter (through a layer or an attribute read)."""
    learned: Set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_module":
            module = root.get_submodule(str(node.target))
            if next(module.parameters(), None) is not None:
                learned.add(node)
        elif node.op == "get_attr" and isinstance(read_attribute(root, str(node.target)), Tensor):
            learned.add(node)
        if any(n in learned for n in node.all_input_nodes) and not reads_metadata(node):
            learned.add(node)
    return learned


def eliminate_dead_code(graph: fx.Graph) -> None:
    """fx's `eliminate_dead_code`, keeping calls that change a tensor in place, whose result
    goes unused while their effect does not (transformers 4's `mask.masked_fill_(...)`)."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op in ("placeholder", "output") or node.is_impure():
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op in ("call_method", "call_function") and isinstance(name, str) and (
                name.endswith("_") and not name.endswith("__")):
            continue
        graph.erase_node(node)


_METADATA = ("dtype", "device", "shape", "ndim", "is_cuda", "requires_grad")


def reads_metadata(node: fx.Node) -> bool:
    """`x.size()`, `x.dim()`, `x.dtype`, `x.device`, `x.shape`: what a mask built from them
    takes from `x` carries no value of it (transformers 4 builds its masks so)."""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return node.op == "call_function" and node.target is getattr and (
        len(node.args) == 2 and node.args[1] in _METADATA)


def has_weights(root: nn.Module, node: fx.Node) -> bool:
    """Does this node apply parameters of its own (a layer, or an attribute it reads)?"""
    if node.op == "call_module":
        return next(root.get_submodule(str(node.target)).parameters(), None) is not None
    return any(
        n.op == "get_attr" and isinstance(read_attribute(root, str(n.target)), Tensor)
        for n in node.all_input_nodes
    )


def is_attention(root: nn.Module, node: fx.Node) -> bool:
    """Is `node` an attention call (a module, function or aten op of attention or softmax)?"""
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        named_attention = "attention" in type(module).__name__.lower()
        return isinstance(module, _ATTENTION_MODULES) or named_attention
    return hashable(node.target) and (
        node.target in R.ATTENTION_TARGETS or node.target in E.ATEN_ATTENTION
    )
