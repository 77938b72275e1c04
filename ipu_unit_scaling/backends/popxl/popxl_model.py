"""The unit-scaled decoder of ``uu.GPT``, written in PopXL.

Written once against ``xl``: the real ``popxl`` module, or its torch stand-in
:mod:`ipu_standins.popxl`. Every unit-scaling rule is the one
:mod:`ipu_unit_scaling.functional` applies; the scales themselves come from there.

**Structure.** The model is a chain of *blocks*, each a PopXL graph called once per
micro-batch (layers of the same shape share graphs). A :class:`Tape` records the calls of one
forward pass and replays them backwards, summing gradients where a tensor feeds several blocks
(the residual stream). Blocks are of two kinds:

- differentiable blocks (embeddings, norms, attention, GELU, residual joins, the loss, and the
  linear layers in FP32): their backward graph comes from ``popxl.transforms.autodiff``;
- FP8 linear layers (:class:`~ipu_unit_scaling.backends.popxl.fp8_ops.FP8LinearBlock`): PopART
cannot
  differentiate FP8 casts or FP8 matmuls, so their backward graph is written by hand.

**Separate backward scales.** Unit scaling multiplies some tensors by one factor in the
forward pass and their gradients by another. Inside differentiable blocks this is written as
the *detach form*: ``scaled(x, a, b) = detach(x * a) + (x * b - detach(x * b))``, whose value
is ``x * a`` (the second term is exactly zero) and whose gradient, as autodiff derives it, is
``b`` times the incoming one (``detach`` has no gradient). It needs no edit of the gradient
graph and holds wherever autodiff runs: on the IPU and in the stand-in. FP8 linear layers apply
their backward scales directly in their hand-written backward graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ... import ops as U
from ...fp8.fp8_config import FP8Config
from ...models.gpt import GPT
from ...modules.gpt_blocks import UNIT_OPS
from ...ops import activation_ops, unit_ops
from ...ops.scale_constraints import ConstraintArg, apply_constraint
from ...training.config_files import ConfigError
from .fp8_ops import AMAX_SOURCES, CastSite, FP8LinearBlock

__all__ = ["DecoderSpec", "LayerSpec", "PopXLDecoder", "Tape", "scaled"]

Tensor = Any  # a popxl.Tensor, the real one's or the stand-in's
# A large finite negative rather than -inf: the IPU traps invalid float operations by
# default, and exp() of it is exactly 0 in float32 all the same.
_MASKED = -1e9


def scaled(xl: Any, x: Tensor, forward: float, backward: float) -> Tensor:
    """``x * forward`` whose gradient autodiff derives as ``backward`` times the incoming one.

    ``detach(x * forward) + (x * backward - detach(x * backward))``: the value is exactly
    ``x * forward`` for finite ``x`` (the bracket is ``y - y = 0``), and only the bracket's
    first term carries a gradient."""
    if forward == backward:
        return x if forward == 1.0 else x * forward
    value = xl.ops.detach(x * forward if forward != 1.0 else x)
    path = x * backward if backward != 1.0 else x
    return value + (path - xl.ops.detach(path))


# ------------------------------------------------------------------------------------ the spec


@dataclass(frozen=True)
class LayerSpec:
    attn_tau: float
    mlp_tau: float
    attn_norm_eps: float
    mlp_norm_eps: float
    # of qkv, proj, up, down
    constraints: Tuple[ConstraintArg, ConstraintArg, ConstraintArg, ConstraintArg]


@dataclass(frozen=True)
class DecoderSpec:
    """What the PopXL decoder needs to know about a ``uu.GPT``."""

    vocab_size: int
    hidden_size: int
    heads: int
    positions: int  # rows of the position embedding (the model's seq_len)
    mlp_hidden: int
    bias: bool
    layers: Tuple[LayerSpec, ...]
    final_norm_eps: float
    head_constraint: ConstraintArg

    @classmethod
    def from_module(cls, module: nn.Module) -> DecoderSpec:
        """Read a ``uu.GPT`` (plain or after ``simulate_fp8``); ConfigError if it
        is something the PopXL decoder does not build."""
        if not isinstance(module, GPT):
            raise ConfigError([("model", f"the popxl backend builds uu.GPT, "
                                         f"not {type(module).__name__}")])
        model: Any = module  # submodules are read by attribute, as the decoder defines them
        if model.ops != UNIT_OPS:  # by value: a deep copy holds an equal Ops
            raise ConfigError([("model.unit_scaled", "the popxl backend builds the unit-scaled "
                                                     "decoder only; set it to true")])
        if model.dropout_p:
            raise ConfigError([("model.dropout", f"got {model.dropout_p}; the popxl backend "
                                                 "has no dropout, use 0")])

        def constraint(linear: nn.Module) -> ConstraintArg:
            return getattr(linear, "constraint", "gmean")

        layers = tuple(
            LayerSpec(
                attn_tau=layer.attn_tau, mlp_tau=layer.mlp_tau,
                attn_norm_eps=layer.attn_norm.eps, mlp_norm_eps=layer.mlp_norm.eps,
                constraints=(constraint(layer.attn.qkv), constraint(layer.attn.proj),
                             constraint(layer.mlp.up), constraint(layer.mlp.down)),
            )
            for layer in model.layers
        )
        first = model.layers[0] if len(model.layers) else None
        return cls(
            vocab_size=model.embedding.num_embeddings,
            hidden_size=model.embedding.embedding_dim,
            heads=first.attn.heads if first is not None else 1,
            positions=model.position_embedding.num_embeddings,
            mlp_hidden=first.mlp.up.out_features if first is not None else 0,
            bias=model.final_norm.bias is not None,
            layers=layers,
            final_norm_eps=model.final_norm.eps,
            head_constraint=constraint(model.head),
        )

    def parameter_names(self) -> List[str]:
        """The state-dict keys of the model, in the order the decoder uses them."""
        names = ["embedding.weight", "position_embedding.weight"]
        biases = (".weight", ".bias") if self.bias else (".weight",)
        for i in range(len(self.layers)):
            for part in ("attn_norm", "attn.qkv", "attn.proj", "mlp_norm", "mlp.up", "mlp.down"):
                names += [f"layers.{i}.{part}{suffix}" for suffix in biases]
        names += [f"final_norm{suffix}" for suffix in biases] + ["head.weight"]
        return names


# ---------------------------------------------------------------------------------- the tape


class AutodiffBlock:
    """A graph of differentiable ops and the gradient graph autodiff derives from it."""

    def __init__(self, xl: Any, ir: Any, fn: Callable[..., Any], inputs: Sequence[Tensor],
                 differentiable: Sequence[bool]):
        self.xl = xl
        self.graph = ir.create_graph(fn, *inputs)
        self.outputs = len(self.graph.outputs)  # autodiff may add outputs for the backward
        self.differentiable = tuple(differentiable)
        required = [t for t, d in zip(self.graph.inputs, differentiable) if d]
        self.grad = xl.transforms.autodiff(self.graph, grads_required=required)

    def forward(self, inputs: Sequence[Tensor], site: str, casts: List[CastSite],
                flags: List[Tensor]) -> Tuple[Tuple[Tensor, ...], Any]:
        info = self.xl.ops.call_with_info(self.graph, *inputs)
        return tuple(info.outputs[:self.outputs]), info

    def backward(self, info: Any, output_grads: Sequence[Tensor], casts: List[CastSite],
                 flags: List[Tensor]) -> List[Optional[Tensor]]:
        grads = iter(self.xl.ops.call(self.grad.graph, *output_grads,
                                      inputs_dict=self.grad.inputs_dict(info)))
        return [next(grads) if d else None for d in self.differentiable]


class Tape:
    """The block calls of one forward pass, for the backward pass (see the module docstring).

    ``casts`` and ``flags`` collect each FP8 cast and each cast's non-finite-amax count."""

    def __init__(self) -> None:
        self._calls: List[Tuple[Any, Tuple[Tensor, ...], Tuple[Tensor, ...], Any]] = []
        self.casts: List[CastSite] = []
        self.flags: List[Tensor] = []

    def call(self, block: Any, *inputs: Tensor, site: str = "") -> Tuple[Tensor, ...]:
        outputs, saved = block.forward(inputs, site, self.casts, self.flags)
        self._calls.append((block, tuple(inputs), outputs, saved))
        return outputs

    def backward(self, seeds: Dict[Tensor, Tensor]) -> Dict[Tensor, Tensor]:
        """Gradients of every differentiable block input, from ``seeds`` (output: gradient)."""
        grads = dict(seeds)
        for block, inputs, outputs, saved in reversed(self._calls):
            if not any(o in grads for o in outputs):
                continue  # nothing downstream needs this call
            output_grads = [grads[o] if o in grads else _zeros_like(block.xl, o)
                            for o in outputs]
            for tensor, grad in zip(inputs, block.backward(saved, output_grads, self.casts,
                                                           self.flags)):
                if grad is not None:
                    grads[tensor] = grads[tensor] + grad if tensor in grads else grad
        return grads


def _zeros_like(xl: Any, t: Tensor) -> Tensor:
    return xl.constant(np.zeros(t.shape, np.float32), xl.float32)


# -------------------------------------------------------------------------------- the decoder


class PopXLDecoder:
    """The unit-scaled ``uu.GPT`` as PopXL graphs, FP8 linears when ``fp8``.

    ``forward(tape, ids, labels, params)`` adds one micro-batch's forward calls to the current
    graph and returns ``(logits, loss)``; ``tape.backward({loss: one})`` then gives every
    parameter's gradient. ``params`` maps state-dict keys to (variable) tensors. ``amax``:
    where FP8 AMAX casts get their scale, "ops" (PopXL ops) or "codelets" (our custom op)."""

    def __init__(self, xl: Any, ir: Any, spec: DecoderSpec, fp8: Optional[FP8Config] = None,
                 amax: str = "ops"):
        if amax not in AMAX_SOURCES:
            raise ValueError(f"amax must be one of {AMAX_SOURCES}, got {amax!r}")
        self.xl = xl
        self.ir = ir
        self.spec = spec
        self.fp8 = fp8
        self.amax = amax
        self._blocks: Dict[Tuple[Any, ...], Any] = {}

    def forward(self, tape: Tape, ids: Tensor, labels: Tensor, params: Dict[str, Tensor]
                ) -> Tuple[Tensor, Tensor]:
        spec = self.spec
        (hidden,) = tape.call(self._embed(ids), ids, params["embedding.weight"],
                              params["position_embedding.weight"])
        for i, layer in enumerate(spec.layers):
            pre = f"layers.{i}."
            qkv_c, proj_c, up_c, down_c = layer.constraints
            normed = self._norm(tape, hidden, params, pre + "attn_norm", layer.attn_tau,
                                layer.attn_norm_eps)
            qkv = self._linear(tape, normed, params, pre + "attn.qkv", qkv_c)
            (attended,) = tape.call(self._attention(qkv), qkv)
            branch = self._linear(tape, attended, params, pre + "attn.proj", proj_c)
            (hidden,) = tape.call(self._join(branch, layer.attn_tau), branch, hidden)
            normed = self._norm(tape, hidden, params, pre + "mlp_norm", layer.mlp_tau,
                                layer.mlp_norm_eps)
            up = self._linear(tape, normed, params, pre + "mlp.up", up_c)
            (activated,) = tape.call(self._gelu(up), up)
            branch = self._linear(tape, activated, params, pre + "mlp.down", down_c)
            (hidden,) = tape.call(self._join(branch, layer.mlp_tau), branch, hidden)
        normed = self._norm(tape, hidden, params, "final_norm", None, spec.final_norm_eps)
        logits = self._linear(tape, normed, params, "head", spec.head_constraint, bias=False)
        (loss,) = tape.call(self._loss(logits, labels), logits, labels)
        return logits, loss

    # ---------------------------------------------------------------------------- blocks

    def _block(self, key: Tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self._blocks:
            self._blocks[key] = make()
        return self._blocks[key]

    def _autodiff_block(self, key: Tuple[Any, ...], fn: Callable[..., Any],
                        inputs: Sequence[Tensor], differentiable: Sequence[bool]) -> Any:
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in inputs)
        return self._block(key + shapes, lambda: AutodiffBlock(self.xl, self.ir, fn, inputs,
                                                               differentiable))

    def _embed(self, ids: Tensor) -> Any:
        xl, spec = self.xl, self.spec
        batch, seq = ids.shape
        vocab, positions = spec.vocab_size, spec.positions
        position_ids = np.arange(seq, dtype=np.int32)

        def embed(ids: Tensor, tokens: Tensor, places: Tensor) -> Tensor:
            # U.embedding: a row's gradient sums over its lookups, sqrt(rows / lookups).
            token_grad = math.sqrt(vocab / (batch * seq))
            # U.add broadcasts the positions over the batch and scales their gradient by
            # batch**-0.5; a gather is linear, so that factor joins the table's own.
            place_grad = math.sqrt(positions / seq) * batch**-0.5
            token = xl.ops.gather(scaled(xl, tokens, 1.0, token_grad), ids)
            place = xl.ops.gather(scaled(xl, places, 1.0, place_grad),
                                  xl.constant(position_ids, xl.int32))
            return (token + place) * 2**-0.5  # U.add's output scale 1/sqrt(1 + alpha**2)

        tokens = xl.TensorSpec((vocab, spec.hidden_size), xl.float32)
        places = xl.TensorSpec((positions, spec.hidden_size), xl.float32)
        return self._autodiff_block(("embed",), embed, [ids, tokens, places],
                                    [False, True, True])

    def _norm(self, tape: Tape, x: Tensor, params: Dict[str, Tensor], name: str,
              split_tau: Optional[float], eps: float) -> Tensor:
        """``layer_norm`` of the residual branch: ``U.residual_split`` (its branch gradient
        weight ``tau / sqrt(1 + tau**2)``) then ``U.layer_norm``."""
        xl = self.xl
        bias = self.spec.bias
        branch_grad = 1.0 if split_tau is None else unit_ops.residual_tau_weights(split_tau)[0]
        rows, width = int(np.prod(x.shape[:-1])), x.shape[-1]
        shape = tuple(x.shape)

        def norm(x: Tensor, weight: Tensor, *maybe_bias: Tensor) -> Tensor:
            branch = scaled(xl, x, 1.0, branch_grad).reshape((rows, width))
            # U.layer_norm: weight and bias gradients sum over rows, rows**-0.5.
            w = scaled(xl, weight, 1.0, rows**-0.5)
            b = (scaled(xl, maybe_bias[0], 1.0, rows**-0.5) if maybe_bias
                 else xl.constant(np.zeros(width, np.float32), xl.float32))
            return xl.ops.layer_norm(branch, w, b, eps).reshape(shape)

        inputs = [x, params[name + ".weight"]] + ([params[name + ".bias"]] if bias else [])
        block = self._autodiff_block(("norm", branch_grad, eps), norm, inputs,
                                     [True] * len(inputs))
        return tape.call(block, *inputs)[0]

    def _linear(self, tape: Tape, x: Tensor, params: Dict[str, Tensor], name: str,
                constraint: ConstraintArg, bias: Optional[bool] = None) -> Tensor:
        xl = self.xl
        has_bias = self.spec.bias if bias is None else bias
        weight = params[name + ".weight"]
        inputs = [x, weight] + ([params[name + ".bias"]] if has_bias else [])
        shapes = (tuple(x.shape), tuple(weight.shape), has_bias, constraint)
        if self.fp8 is not None:
            fp8 = self.fp8
            block = self._block(("fp8_linear",) + shapes, lambda: FP8LinearBlock(
                xl, self.ir, x, weight, has_bias, constraint, fp8, self.amax))
            return tape.call(block, *inputs, site=name)[0]
        out_features, in_features = weight.shape
        rows = int(np.prod(x.shape[:-1]))
        output_scale, grad_input_scale, grad_weight_scale = U.linear_scales(
            in_features, out_features, rows, constraint)

        def linear(x: Tensor, weight: Tensor, *maybe_bias: Tensor) -> Tensor:
            # U.linear: the output scale is folded into the weight, whose gradient then takes
            # the grad-weight scale instead; the input keeps the ratio of the two.
            x = scaled(xl, x, 1.0, grad_input_scale / output_scale)
            w = scaled(xl, weight, output_scale, grad_weight_scale)
            y = x @ w.transpose()
            return (y + scaled(xl, maybe_bias[0], output_scale, grad_weight_scale)
                    if maybe_bias else y)

        block = self._autodiff_block(("linear",) + shapes, linear, inputs, [True] * len(inputs))
        return tape.call(block, *inputs)[0]

    def _attention(self, qkv: Tensor) -> Any:
        """Causal ``U.scaled_dot_product_attention`` after MHSA's head split."""
        xl = self.xl
        batch, seq, width3 = qkv.shape
        heads, width = self.spec.heads, width3 // 3
        head_dim = width // heads
        mask = np.triu(np.full((seq, seq), _MASKED, np.float32), k=1)
        # The same per-row scale U computes: sqrt(1 / E[sum p**2]) for the keys a row sees.
        visible = torch.arange(1, seq + 1, dtype=torch.float32).unsqueeze(-1)
        row_scale = ((1 - 0.0) / activation_ops.expected_softmax_square_sum(visible)) ** 0.5
        row_scale = row_scale.numpy().astype(np.float32)

        def attention(qkv: Tensor) -> Tensor:
            ops = xl.ops

            def heads_first(t: Tensor) -> Tensor:
                return t.reshape((batch, seq, heads, head_dim)).transpose((0, 2, 1, 3))

            query, key, value = (heads_first(t) for t in ops.split(qkv, 3, axis=2))
            logits = (query @ key.transpose((0, 1, 3, 2))) * head_dim**-0.5
            probs = ops.softmax(logits + xl.constant(mask, xl.float32), axis=3)
            out = (probs @ value) * xl.constant(row_scale, xl.float32)
            return out.transpose((0, 2, 1, 3)).reshape((batch, seq, width))

        return self._autodiff_block(("attention", heads), attention, [qkv], [True])

    def _gelu(self, x: Tensor) -> Any:
        xl = self.xl
        # U.gelu with its default gmean constraint: one scale both ways, unless a constraint
        # leaves them apart.
        output_scale, grad_scale = apply_constraint("gmean", *_gelu_scales())

        def gelu(x: Tensor) -> Tensor:
            x = scaled(xl, x, 1.0, grad_scale / output_scale)
            return xl.ops.geluerf(x) * output_scale

        return self._autodiff_block(("gelu",), gelu, [x], [True])

    def _join(self, branch: Tensor, tau: float) -> Any:
        """``U.residual_add``: ``a * branch + b * skip``, the branch scaled forward only."""
        xl = self.xl
        branch_weight, skip_weight = unit_ops.residual_tau_weights(tau)

        def join(branch: Tensor, skip: Tensor) -> Tensor:
            return skip * skip_weight + scaled(xl, branch, branch_weight, 1.0)

        return self._autodiff_block(("join", tau), join, [branch, branch], [True, True])

    def _loss(self, logits: Tensor, labels: Tensor) -> Any:
        """``U.cross_entropy`` (mean): torch's value, the logits' gradient scaled to unit."""
        xl = self.xl
        shape = tuple(logits.shape)
        classes, rows = shape[-1], int(np.prod(shape[:-1]))
        square_sum = activation_ops.expected_softmax_square_sum(classes)
        per_element_var = (1 - 2 / classes + square_sum) / classes
        grad_scale = rows * per_element_var**-0.5

        def loss(logits: Tensor, labels: Tensor) -> Tensor:
            flat = scaled(xl, logits.reshape((rows, classes)), 1.0, grad_scale)
            probs = xl.ops.softmax(flat, axis=1)
            return xl.ops.nll_loss(probs, labels.reshape((rows,)), reduction="mean")

        return self._autodiff_block(("loss",), loss, [logits, labels], [True, False])


def _gelu_scales() -> Tuple[float, float]:
    out_std, grad_rms = activation_ops.GELU_STDS["none"]
    return 1 / out_std, 1 / grad_rms
