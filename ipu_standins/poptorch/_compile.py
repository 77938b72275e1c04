"""How the stand-in compiles a model: PopTorch's trace, then PopTorch's graph rules.

:func:`compile_graph` traces one micro-batch of the model with
:func:`._tracer.trace_like_poptorch` (fake tensors: host reads, moves to the CPU, float8
tensors and ops PopTorch has no handler for are refused; ``autograd.Function`` backwards
are not used: gradients come from the traced forward graph, as PopART's autodiff computes
them), with ``poptorch.isRunningOnIpu()`` true and
the blocks the model begins recorded. Then, as PopTorch does after tracing:

- a training graph must hold exactly one final loss once dead code is removed: a
  ``poptorch.identity_loss`` or a torch loss function (``F.mse_loss``, ``nn.CrossEntropyLoss``,
  ...) whose result no other loss consumes ("Couldn't find a loss in graph!", "Multiple
  independent losses found ...": ``RemoveSurplusIdentityLosses.cpp``);
- under ``PipelinedExecution``, a new pipeline stage begins at every change of IPU in
  execution order (``CompilerImpl::numPipelineStages``), so a head tied back to IPU 0 adds a
  stage; training needs ``gradientAccumulation`` >= ``2 x stages - 1`` and inference
  ``deviceIterations`` >= stages (``Compiler.cpp``);
- numerics (:mod:`._numerics`): half partials for half matmuls, the IPU Model's GELU gradient.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from . import _numerics, _state
from ._args import Args, flatten, rebuild
from ._graph_ops import LOSS_OPS, torch_loss_op
from ._impl import createPoptorchError
from ._tracer import PopTorchTrace, trace_like_poptorch
from .poptorch_core import Error

__all__ = ["CompiledGraph", "compile_graph", "pipeline_stages", "check_pipeline"]

_LOSS_FUNCTIONS = frozenset(getattr(F, name) for name in (
    "l1_loss", "mse_loss", "nll_loss", "cross_entropy", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "kl_div",
    "soft_margin_loss", "multilabel_soft_margin_loss", "multilabel_margin_loss",
    "cosine_embedding_loss", "margin_ranking_loss", "hinge_embedding_loss",
    "poisson_nll_loss", "gaussian_nll_loss", "triplet_margin_loss", "ctc_loss",
    "multi_margin_loss", "triplet_margin_with_distance_loss") if hasattr(F, name))


# Ops whose weights take the activation's dtype when the two differ (PopTorch: a float16
# activation with float32 weights computes in float16, and the other way round in float32).
_WEIGHTED = frozenset(getattr(F, name) for name in (
    "linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "layer_norm", "group_norm", "batch_norm", "instance_norm", "prelu")
    if hasattr(F, name))
_HALF_FLOAT = (torch.float16, torch.float32)


def _like_activation(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _HALF_FLOAT and value.dtype != dtype:
        return value.to(dtype)
    return value


class _TraceMode(TorchFunctionMode):
    """While tracing: marks the result of each torch loss function with
    ``poptorch::torch_loss`` (training), and refuses ops outside any block once a
    ``poptorch.Block`` has ended ("No active Block", as PopTorch)."""

    def __init__(self, training: bool):
        super().__init__()
        self.training = training

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        # ``device="ipu"`` is left to the trace's rules (`._tracer`), which tell the IPU from
        # the CPU.
        kwargs = dict(kwargs or {})
        if func in _WEIGHTED and args and isinstance(args[0], torch.Tensor) and (
                args[0].dtype in _HALF_FLOAT):
            dtype = args[0].dtype
            args = (args[0],) + tuple(_like_activation(a, dtype) for a in args[1:])
            kwargs = {k: _like_activation(v, dtype) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if _state.BLOCK_ENDED and isinstance(out, torch.Tensor) and getattr(
                func, "__name__", "") not in ("__get__", "__set__"):
            raise Error("No active Block: once a poptorch.Block has ended, every op must be "
                        "inside a Block")
        if self.training and func in _LOSS_FUNCTIONS and isinstance(out, torch.Tensor) and (
                out.is_floating_point()):
            return torch_loss_op(out)
        return out


class _Call(torch.nn.Module):
    """The user's model called with one call's arguments, tensors given flat; returns its
    outputs' tensors flat (their structure is kept in ``output_template``)."""

    def __init__(self, model: torch.nn.Module, template: Args, training: bool):
        super().__init__()
        self.model = model
        self.template = template
        self.training_graph = training
        self.output_template: Any = None

    def forward(self, *tensors: torch.Tensor) -> Any:
        args, kwargs = self.template.with_tensors(list(tensors))
        before = dict(self.model.named_buffers())
        with _TraceMode(self.training_graph):
            out = self.model(*args, **kwargs)
        after = dict(self.model.named_buffers())
        for name, buffer in before.items():
            if name not in after:
                raise createPoptorchError(
                    f"Buffer {name} is removed from the model when calling the forward method.")
            if after[name] is not buffer:
                raise createPoptorchError(
                    f"Buffer {name} is reassigned within the model when calling the forward "
                    "method. This is not supported. Consider using "
                    f"self.{name}.copy_(src) to copy data from a source tensor, where src is "
                    "the name of the source tensor.")
        self.output_template = out
        return flatten(out)


class CompiledGraph:
    """One micro-batch's graph: ``graph(parameters, buffers, *inputs)`` returns the output
    tensors flat (and, for training, the final loss: ``(outputs, loss)``);
    ``rebuild(tensors)`` gives them the model's output structure."""

    def __init__(self, trace: PopTorchTrace, training: bool, blocks: List[Tuple[Any, ...]],
                 module: _Call):
        self.trace = trace
        self.training = training
        self.blocks = blocks
        self.output_template = module.output_template
        named_parameters = dict(module.named_parameters())
        named_buffers = dict(module.named_buffers())
        self.parameters = [named_parameters[n] for n in trace.parameter_names]
        self.buffers = [named_buffers[n] for n in trace.buffer_names]

    def __call__(self, parameters: List[torch.Tensor], buffers: List[torch.Tensor],
                 *tensors: torch.Tensor) -> Any:
        previous, _state.ON_IPU = _state.ON_IPU, True
        try:
            return self.trace.graph(parameters, buffers, *tensors)
        finally:
            _state.ON_IPU = previous

    def capturing(self, nodes: Set[str], parameters: List[torch.Tensor],
                  buffers: List[torch.Tensor], *tensors: torch.Tensor
                  ) -> Tuple[Any, Dict[str, torch.Tensor]]:
        """``self(parameters, buffers, *tensors)``, and the values of the graph's ``nodes``
        (by node name) as they were computed: detached copies (anchored tensors)."""
        captured: Dict[str, torch.Tensor] = {}

        class Capture(fx.Interpreter):
            def run_node(self, node: fx.Node) -> Any:
                value = super().run_node(node)
                if node.name in nodes and isinstance(value, torch.Tensor):
                    captured[node.name] = value.detach().clone()
                return value

        previous, _state.ON_IPU = _state.ON_IPU, True
        try:
            out = Capture(self.trace.graph).run(parameters, buffers, *tensors)
        finally:
            _state.ON_IPU = previous
        return out, captured

    def rebuild(self, tensors: List[torch.Tensor]) -> Any:
        return rebuild(self.output_template, list(tensors))


def _live_nodes(graph: torch.fx.Graph) -> set:
    output = next(n for n in graph.nodes if n.op == "output")
    live, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    return live


def _feeds_a_loss(node: torch.fx.Node) -> bool:
    seen, stack = set(), list(node.users)
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and user.target in LOSS_OPS:
            return True
        stack.extend(user.users)
    return False


def _attach_final_loss(trace: PopTorchTrace) -> None:
    graph = trace.graph.graph
    live = _live_nodes(graph)
    losses = [n for n in graph.nodes if n.op == "call_function" and n.target in LOSS_OPS
              and n in live]
    if not losses:
        raise createPoptorchError("Couldn't find a loss in graph!")
    final = [n for n in losses if not _feeds_a_loss(n)]
    if len(final) != 1:
        raise createPoptorchError(
            "Multiple independent losses found in graph. Graph must have one final loss. "
            "Wrap final graph loss in poptorch.identity_loss.")
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])  # the model's output tensors, flat (see _Call)
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:  # the graph returns a pytree
        output.args = (outputs + [final[0]],)
        spec = tree_flatten((list(range(len(outputs))), 0))[1]
        graph._codegen.pytree_info = info._replace(out_spec=spec)  # type: ignore[attr-defined]
    else:
        output.args = ((outputs, final[0]),)
    trace.graph.recompile()


def _writes_buffers(trace: PopTorchTrace) -> bool:
    """Whether the graph writes any buffer in place (BatchNorm's running statistics...)."""
    graph = trace.graph.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first = len(trace.parameter_names)
    buffers = set(placeholders[first:first + len(trace.buffer_names)])
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for value, argument in zip(node.args, schema.arguments):
            if isinstance(value, fx.Node) and value in buffers and (
                    argument.alias_info is not None) and (
                    argument.alias_info.is_write):
                return True
    return False


def pipeline_stages(blocks: List[Tuple[Any, ...]]) -> int:
    """Forward pipeline stages: one, plus one at every change of IPU between consecutive
    blocks in execution order."""
    ipus = [block[3] for block in blocks]
    return 1 + sum(1 for a, b in zip(ipus, ipus[1:]) if a != b)


def check_pipeline(options: Any, training: bool, forward_stages: int) -> None:
    """PopTorch's compile-time checks of a pipelined model (``Compiler.cpp``)."""
    from ._strategies import PipelinedExecution, ShardedExecution

    strategy = options._execution_strategy
    if not isinstance(strategy, PipelinedExecution) or isinstance(strategy, ShardedExecution):
        return
    if training:
        stages = 2 * forward_stages - 1
        if options.Training.gradient_accumulation < stages:
            raise Error(
                "poptorch.Options().Training.gradientAccumulation must be greater than or "
                f"equal to the number of pipeline stages ({stages}) when using "
                f"poptorch.PipelinedExecution. Please note that a model with {forward_stages} "
                "pipeline stages in PopTorch will have an additional "
                f"{forward_stages - 1} stages when training.")
    elif options.device_iterations < forward_stages:
        raise Error(
            "poptorch.Options().deviceIterations must be greater than or equal to the number "
            f"of pipeline stages ({forward_stages}) when using PopTorch.PipelinedExecution.")


def compile_graph(model: torch.nn.Module, template: Args, example: List[torch.Tensor],
                  options: Any, training: bool) -> CompiledGraph:
    """Trace ``model`` on one micro-batch and apply PopTorch's graph rules (module doc)."""
    strategy = options._execution_strategy
    popart = options._Popart.options
    _state.BLOCKS = []
    _state.BLOCK_ENDED = False
    _state.TRAINING = training
    strategy.onStartTracing()
    module = _Call(model, template, training)
    previous, _state.ON_IPU = _state.ON_IPU, True
    # As PopTorch: torch.distributions' argument checks read values on the host; off while
    # tracing.
    validate = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        trace = trace_like_poptorch(
            module, *example, allow_constants=True,
            stochastic_rounding=bool(popart.get("enableStochasticRounding", False)))
    except (TypeError, ValueError, RuntimeError, IndexError) as error:
        # torch's own errors name the fake tensors of the trace; the IPU's are Tensors.
        message = str(error)
        if "FakeTensor" not in message or isinstance(error, Error):
            raise
        try:
            renamed = type(error)(message.replace("FakeTensor", "Tensor"))
        except Exception:  # an error type that takes other arguments
            raise error from None
        raise renamed from None
    finally:
        torch.distributions.Distribution.set_default_validate_args(validate)
        _state.ON_IPU = previous
        _state.BLOCK_ENDED = False
        _state.TRAINING = False
        strategy.onEndTracing()
    blocks, _state.BLOCKS = list(_state.BLOCKS), []
    unsupported = {op: where for op, where in trace.report.unsupported.items()
                   if not op.startswith("poptorch::")}
    if unsupported:
        trace.report.unsupported = unsupported
        raise Error(str(trace.report))
    if training:
        _attach_final_loss(trace)
        if options.replication_factor > 1 and options.broadcast_buffers and (
                _writes_buffers(trace)):
            raise createPoptorchError(
                "PopTorch does not support broadcasting buffers. If your model is able to "
                "tolerate buffers becoming out of sync between replicas, you can disable "
                "buffer broadcasting using poptorch.Options.broadcastBuffers(False).")
    check_pipeline(options, training, pipeline_stages(blocks))
    _numerics.apply(trace.graph, half_partials=popart.get("partialsTypeMatMuls") == "half",
                    ipu_model=bool(options._values.get("use_model", False)),
                    half_conv_partials=dict(popart.get("convolutionOptions") or {}).get(
                        "partialsType") == "half",
                    strided_groups=bool(popart.get("groupNormStridedChannelGrouping", False)))
    return CompiledGraph(trace, training, blocks, module)

