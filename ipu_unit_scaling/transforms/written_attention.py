"""Attention written out as matmul, scale, mask, softmax and matmul, read as one attention call.

transformers 4 writes each model's attention out in full (`torch.matmul(q, k.transpose(-1, -2))
/ math.sqrt(d)`, an additive mask, `softmax`, dropout, `torch.matmul(probs, v)`). Op by op, the
scale, the additive mask and the clamp at the dtype's minimum have no unit-scaled form, and the
softmax would not know how many keys each query sees. Read as
`F.scaled_dot_product_attention` with a boolean mask, the whole is converted to the unit-scaled
attention, as transformers 5's fused attention is.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.trace_switch import is_ipu_tracing
from .graph import reads_metadata

__all__ = ["fuse_written_attention", "allowed_keys"]

_SOFTMAX = {F.softmax, torch.softmax, "softmax"}
_MATMUL = {torch.matmul, operator.matmul, "matmul"}
_ADD = {operator.add, torch.add, "add"}
_RETYPE = {"to", "type", "type_as"}
_CONSTANT_FACTORIES = {torch.tensor, torch.full}
# F.scaled_dot_product_attention's `scale` argument came with torch 2.1.
_SDPA_TAKES_SCALE = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 1)


def allowed_keys(additive: Optional[Tensor], causal: Optional[Tensor]) -> Tensor:
    """The boolean mask (True: may attend) equal to an additive mask of 0 and the dtype's
    minimum (or -inf), and a boolean causal mask; another additive value is refused."""
    allowed = causal
    if additive is not None:
        open_keys = additive == 0
        if not is_ipu_tracing():  # PopTorch's trace cannot read a value
            blocked = additive <= torch.finfo(additive.dtype).min
            if not bool(torch.all(open_keys | blocked)):
                raise ValueError(
                    "unit_scale's attention takes additive masks of 0 and the dtype's minimum "
                    "only: another value changes the softmax's scale by an amount it cannot know")
        allowed = open_keys if allowed is None else allowed & open_keys
    assert allowed is not None
    return allowed


def _is(node: Any, op: str, targets: Set[Any]) -> bool:
    return isinstance(node, fx.Node) and node.op == op and node.target in targets


def _call(node: Any, targets: Set[Any]) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and (
        node.target in targets)


def _argument(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _number(value: Any) -> Optional[float]:
    """A constant factor: a number, or `torch.full([], number)` (GPT-2's head-size root)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if _is(value, "call_function", {torch.full}) and _argument(value, 0, "size") in ([], ()):
        fill = _argument(value, 1, "fill_value")
        return value.meta.get("example_scalar") if isinstance(fill, fx.Node) else _number(fill)
    return None


def _constant(node: Any) -> bool:
    """A tensor made from numbers, such as the dtype's minimum, or a stored constant."""
    while _call(node, _RETYPE):
        node = node.args[0]
    return _is(node, "call_function", _CONSTANT_FACTORIES) or (
        isinstance(node, fx.Node) and node.op == "get_attr")


def _transposed_key(node: Any) -> Optional[fx.Node]:
    """k for `k.transpose(-1, -2)` (or (2, 3), of a 4-d key)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method" and node.target == "transpose":
        key, dims = node.args[0], set(node.args[1:3])
    elif node.op == "call_function" and node.target is torch.transpose:
        key, dims = node.args[0], set(node.args[1:3])
    else:
        return None
    return key if dims in ({-1, -2}, {2, 3}) and isinstance(key, fx.Node) else None


def _scores(node: fx.Node) -> Optional[Tuple[fx.Node, fx.Node, float, Any, Any, List[fx.Node]]]:
    """(q, k, scale, additive mask, causal mask, nodes) of the logits ending at `node`."""
    scale, additive, causal, nodes = 1.0, None, None, []
    current: Any = node
    while isinstance(current, fx.Node):
        nodes.append(current)
        if _call(current, _MATMUL):
            query, key = current.args[0], _transposed_key(current.args[1])
            if key is None or not isinstance(query, fx.Node):
                return None
            nodes.append(current.args[1])  # type: ignore[arg-type]  # (a node: see above)
            return query, key, scale, additive, causal, nodes
        if _call(current, _RETYPE):
            current = current.args[0]
        elif _is(current, "call_function", {torch.max}) and len(current.args) == 2 and _constant(
                current.args[1]):
            current = current.args[0]  # the clamp at the dtype's minimum (Llama)
        elif _is(current, "call_function", {torch.where}) and len(current.args) == 3 and _constant(
                current.args[2]) and causal is None:
            causal, current = current.args[0], current.args[1]  # GPT-2's causal mask
        elif _call(current, _ADD) and len(current.args) == 2 and additive is None:
            current, additive = current.args
        elif _call(current, {operator.truediv, torch.div, "div"}) and len(current.args) == 2:
            divisor = _number(current.args[1])
            if not divisor:
                return None
            scale, current = scale / divisor, current.args[0]
        elif _call(current, {operator.mul, torch.mul, "mul"}) and len(current.args) == 2:
            factor = _number(current.args[1])
            if factor is None:
                return None
            scale, current = scale * factor, current.args[0]
        else:
            return None
    return None


def _output(root: nn.Module, softmax: fx.Node) -> Optional[Tuple[fx.Node, fx.Node, float]]:
    """(the `probs @ v` node, v, dropout probability) after `softmax`."""
    p = 0.0
    current = softmax
    while True:
        users = [u for u in current.users if not reads_metadata(u)]
        if len(users) != 1:
            return None
        user = users[0]
        if _call(user, _MATMUL) and user.args[0] is current and isinstance(user.args[1], fx.Node):
            return user, user.args[1], p
        if _call(user, _RETYPE) and user.args[0] is current:
            current = user
        elif user.op == "call_module" and isinstance(
                dropout := root.get_submodule(str(user.target)), nn.Dropout) and not p:
            p, current = float(dropout.p), user
        elif _is(user, "call_function", {F.dropout}) and not p and user.args[0] is current:
            training = bool(_argument(user, 2, "training", True))
            p, current = float(_argument(user, 1, "p", 0.5)) if training else 0.0, user
        else:
            return None


def _replaced(nodes: List[fx.Node], output: fx.Node) -> Optional[List[fx.Node]]:
    """`nodes` and everything that reads them, up to `output`, in graph order; None if any
    of it is more than a step of the attention or a check on it (a result returned, a layer
    called, a tensor changed in place)."""
    found: Set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        if node is not output:
            todo.extend(node.users)
    for node in found - set(nodes):
        if node.op in ("output", "call_module", "placeholder") or (
                node.op == "call_method" and str(node.target).endswith("_")):
            return None
    order = {node: i for i, node in enumerate(output.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def fuse_written_attention(
    root: nn.Module, graph: fx.Graph, tensor_nodes: Optional[Set[str]]
) -> int:
    """Replace each attention written out in `graph` by `F.scaled_dot_product_attention`;
    returns how many. The new nodes are added to `tensor_nodes` where they carry data."""
    fused = 0
    for softmax in list(graph.nodes):
        if not _call(softmax, _SOFTMAX) or _argument(softmax, 1, "dim") != -1:
            continue
        logits = softmax.args[0]
        found = _scores(logits) if isinstance(logits, fx.Node) else None
        after = _output(root, softmax)
        if found is None or after is None:
            continue
        query, key, factor, additive, causal, nodes = found
        matmul, value, p = after
        chain = [matmul]
        while chain[-1] is not softmax:
            chain.append(chain[-1].args[0])  # type: ignore[arg-type]
        replaced = _replaced(chain + nodes, matmul)
        if replaced is None:
            continue
        head_dim = query.meta.get("example_shape", (None,))[-1]
        scale: Optional[float] = factor
        if head_dim and abs(factor * head_dim ** 0.5 - 1) < 1e-6:
            scale = None  # torch's default, which the gradient rules of the projections know
        if scale is not None and not _SDPA_TAKES_SCALE:
            continue  # left written out: torch's attention has no other scale before 2.1
        with graph.inserting_before(matmul):
            mask = None
            if additive is not None or causal is not None:
                mask = graph.call_function(allowed_keys, (additive, causal))
            options: Dict[str, Any] = {"attn_mask": mask, "dropout_p": p}
            if scale is not None:
                options["scale"] = scale
            attention = graph.call_function(
                F.scaled_dot_product_attention, (query, key, value), options)
        matmul.replace_all_uses_with(attention)
        if tensor_nodes is not None:
            tensor_nodes.add(attention.name)
        for node in reversed(replaced):
            graph.erase_node(node)
        fused += 1
    return fused
