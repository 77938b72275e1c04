"""`unit_scale(model)`: a unit-scaled copy of an existing PyTorch model.

(Over 600 lines because the graph rewrite is one pass, `_Converter`, whose rules for modules,
functions, residuals and attention read against each other; the rules with no state of their
own already live in `replacements`, `graph` and `export`.)

The model is traced with torch.fx (see `fx_tracing.ConcreteTracer`); where fx fails and example
inputs were given, with `torch.export` (see `export`), which sees concrete shapes. The graph is
then rewritten:

- modules with unit-scaled versions (Linear, LayerNorm, Embedding, GELU, ReLU, Softmax, Dropout,
  CrossEntropyLoss, MultiheadAttention, Hugging Face Conv1D and GELU activations) are replaced
  by fresh unit-initialised ones;
- torch functions with unit-scaled versions (`F.gelu`, `F.softmax`, `torch.matmul`,
  `F.scaled_dot_product_attention`, `F.cross_entropy`, ...) call the `U` op instead, and
  `F.dropout` becomes a `uu.Dropout` module, so it follows `model.train()` / `model.eval()`;
- a product `x * silu(g)` (a SwiGLU gate) becomes `U.silu_glu`; rotary position embeddings
  are kept as they are (they preserve scale; see `replacements.scale_preserving_functions`);
- an addition whose one operand feeds the other through layers with weights is a residual:
  it becomes `residual_split` at the fork and `residual_add` at the join, with `attn_tau` when
  the branch contains attention and `mlp_tau` otherwise; other sums of two learned tensors
  become `U.add`.

A module that neither tracer can trace is kept, and its children are converted one by one: their
own residuals are found, but the kept module's own arithmetic stays unscaled and is reported.
Everything left unscaled is listed in a `UnitScaleWarning`; ops that carry no gradient (rotary
tables, masks and positions built from buffers and shapes) are not listed. Weights tied in the
model (an input embedding shared with the output layer) stay tied in the copy.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    TypeVar,
    Union,
)

import torch
import torch.fx as fx
from torch import nn

from .. import modules as uu
from . import export as E
from . import replacements as R
from .call_structures import keep_root
from .compose import apply_transform, transforms_of, without_transforms
from .fx_tracing import (
    ArgumentFrame,
    FailedAssertion,
    Inputs,
    SpecialisedCall,
    capture_inputs,
    function_behind,
    trace_module,
    transformers_unsupported,
)
from .graph import (
    eliminate_dead_code,
    first_line,
    gradient_nodes,
    has_tensor_input,
    has_weights,
    hashable,
    is_attention,
    learned_nodes,
    mark_attention_projections,
    node_order,
    nodes_between,
    read_attribute,
    residual_operands,
    set_submodule,
    share_input_scales,
    silu_input,
    target_name,
)
from .keep_structure import (
    inlined_blocks,
    install_forward,
    is_trunk,
    is_trunk_leaf,
    mark_converted,
)
from .written_attention import fuse_written_attention

__all__ = ["unit_scale", "unit_scale_with_report", "UnitScaleReport", "UnitScaleWarning"]

ModuleKey = Union[str, type]
M = TypeVar("M", bound=nn.Module)
logger = logging.getLogger(__name__)


class UnitScaleWarning(UserWarning):
    """Some ops of a model could not be unit-scaled and run as they were."""


@dataclass
class UnitScaleReport:
    """What `unit_scale` did: converted ops, residuals, and what it left unscaled."""

    converted: List[str] = field(default_factory=list)
    residuals: List[str] = field(default_factory=list)
    unconverted: List[str] = field(default_factory=list)
    untraceable: List[str] = field(default_factory=list)
    specialised: List[str] = field(default_factory=list)
    # One line per traced module: which tracer traced it ("torch.fx" or "torch.export ...").
    tracers: List[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"{len(self.converted)} ops converted, {len(self.residuals)} residuals, "
            f"{len(self.unconverted)} ops left unscaled"
        ]
        exported = [t for t in self.tracers if ": torch.export" in t]
        if exported:
            lines.append("traced with torch.export: " + "; ".join(exported))
        if self.unconverted:
            lines.append("left unscaled: " + ", ".join(self.unconverted))
        if self.untraceable:
            lines.append("not traced (children converted one by one): "
                         + "; ".join(self.untraceable))
        return "\n".join(lines)


# Unit-scaled modules that are already what unit_scale would produce.
_UNIT_MODULES = (
    SpecialisedCall, fx.GraphModule, uu.Linear, uu.Conv1d, uu.LayerNorm, uu.Embedding, uu.GELU,
    uu.ReLU,
    uu.Softmax, uu.Dropout, uu.CrossEntropyLoss, uu.RMSNorm, uu.SiLU, R.UnitMultiheadAttention,
    R.UnitConv1D, R.UnitAttention,
)
# Leaf modules that leave scales alone.
_NEUTRAL_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)
_ADD = R.ADD_TARGETS | E.ATEN_ADD
_SUB = R.SUB_TARGETS | E.ATEN_SUB
_MUL = R.MUL_TARGETS | E.ATEN_MUL
_DROPOUT = R.DROPOUT_TARGETS | E.ATEN_DROPOUT
_INSERTED = (R.unit_residual_branch, R.unit_residual_add, R.unit_silu_glu)


def unit_scale(
    model: M,
    example_inputs: Optional[Sequence[Any]] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    skip: Iterable[ModuleKey] = (),
    replacements: Optional[Mapping[ModuleKey, Callable[[nn.Module], nn.Module]]] = None,
    function_replacements: Optional[Mapping[Any, Callable[..., Any]]] = None,
    replace: Optional[Mapping[Callable[..., Any], Callable[..., Any]]] = None,
    attn_tau: float = 0.01,
    mlp_tau: float = 0.5,
    seed: int = 0,
    keep_structure: bool = False,
) -> M:
    """Return a unit-scaled copy of `model`; `model` itself is not changed.

    - `example_inputs` / `example_kwargs`: one call's arguments. They let tracing resolve Python
      control flow (shape checks, optional masks); the copy is specialised to the branches they
      take and to their non-tensor arguments. Without them, an `assert` on a traced value stays
      in the graph as a check, and the model is traced as called with every argument given;
      the copy is then the model's own class and object, with its attributes and methods,
      and a call that leaves an argument None (or passes a flag or a number) is converted
      when its structure first comes (see `call_structures`). A model with other control flow
      on traced values is converted module by module.
    - `skip`: qualified module names or module classes to leave exactly as they are.
    - `replacements`: qualified names or classes mapped to a function that builds the
      replacement from the original module (checked before the built-in conversions).
    - `function_replacements`: torch functions (or method names such as "tanh") mapped to a
      function with the same arguments.
    - `replace` (unit_scaling's argument): Python functions the model's modules call (by a
      global name or a closure variable of their `forward`) mapped to a function to trace in
      their place, as one call, not traced through: `{my_gelu: F.gelu}` makes a hand-written
      GELU the unit-scaled one. A dict given second is taken as `replace`, as unit_scaling's
      `unit_scale(module, replace)`.
    - `attn_tau`, `mlp_tau`: branch-to-skip weight ratios of residuals whose branch does / does
      not contain attention.
    - `seed`: the converted weights are drawn from this seed (the caller's RNG is untouched), so
      two conversions of one model are identical.
    - `keep_structure`: the copy keeps the model's modules, classes and parameter names, each
      traced module with its converted forward (see `keep_structure`), for libraries that walk
      and reload the model (Optimum Graphcore's IPUTrainer, PopTorch's blocks); a Hugging Face
      model's class becomes `UnitScaled<Name>`, a subclass. Without it the copy's traced
      modules are graph modules (`SpecialisedCall` where example inputs fixed arguments).

    Ops that could not be converted are listed in a `UnitScaleWarning`.

    Graph transforms applied to `model` before (`transforms.simulate_fp8`, `track_scales`, ...)
    are applied again to the converted model, after unit scaling: unit scaling comes first.
    `converted.backends` lists the transforms the copy carries, first to last, as unit-scaling
    records them (unit scaling's entry, then each graph transform's backend).
    """
    if isinstance(example_inputs, Mapping) and example_kwargs is None and replace is None:
        example_inputs, replace = None, example_inputs  # unit_scale(module, replace)
    backends = transforms_of(model)
    if backends:
        logger.info("unit scaling the model before its %d graph transform(s)", len(backends))
        model = without_transforms(copy.deepcopy(model))
    converted, report = unit_scale_with_report(
        model, example_inputs, example_kwargs, skip=skip, replacements=replacements,
        function_replacements=function_replacements, replace=replace, attn_tau=attn_tau,
        mlp_tau=mlp_tau, seed=seed, keep_structure=keep_structure,
    )
    converted.backends = [_unit_scaling_backend]  # type: ignore[assignment]
    for backend in backends:
        converted = apply_transform(converted, backend)
    if report.unconverted or report.untraceable:
        warnings.warn(
            "unit_scale left some ops unscaled; they run as in the original model:\n"
            + report.summary(), UnitScaleWarning, stacklevel=2,
        )
    return converted  # type: ignore[return-value]  # a module in place of the model


def _unit_scaling_backend(gm: fx.GraphModule, example_inputs: List[Any]) -> fx.GraphModule:
    """unit_scale's entry in `model.backends`, the list of transforms a model carries, first to
    last (unit-scaling's record, which scripts read to name a run). The conversion itself is
    done when `unit_scale` runs; as a backend this entry passes a graph through unchanged."""
    return gm


def unit_scale_with_report(
    model: nn.Module,
    example_inputs: Optional[Sequence[Any]] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    skip: Iterable[ModuleKey] = (),
    replacements: Optional[Mapping[ModuleKey, Callable[[nn.Module], nn.Module]]] = None,
    function_replacements: Optional[Mapping[Any, Callable[..., Any]]] = None,
    replace: Optional[Mapping[Callable[..., Any], Callable[..., Any]]] = None,
    attn_tau: float = 0.01,
    mlp_tau: float = 0.5,
    seed: int = 0,
    keep_structure: bool = False,
) -> tuple[nn.Module, UnitScaleReport]:
    """`unit_scale` without the warning: returns `(converted_model, report)`."""
    unsupported = transformers_unsupported(model)
    if unsupported is not None:
        raise RuntimeError(unsupported)
    copied = copy.deepcopy(model)
    settings = _Settings(set(skip), dict(replacements or {}), dict(function_replacements or {}),
                         dict(replace or {}), attn_tau, mlp_tau, seed, keep_structure)
    return _unit_scale_copy(copied, example_inputs, example_kwargs, settings, model.training)


@dataclass
class _Settings:
    """unit_scale's arguments that say how to convert, kept to convert later calls alike."""

    skip: Set[ModuleKey]
    replacements: Dict[ModuleKey, Callable[[nn.Module], nn.Module]]
    function_replacements: Dict[Any, Callable[..., Any]]
    replace: Dict[Callable[..., Any], Callable[..., Any]]
    attn_tau: float
    mlp_tau: float
    seed: int
    keep_structure: bool

    def converter(self, captured: Dict[str, Inputs]) -> _Converter:
        return _Converter(
            captured=captured, skip=self.skip, replacements=self.replacements,
            functions={**R.FUNCTION_ADAPTERS, **E.ATEN_ADAPTERS, **self.function_replacements},
            attn_tau=self.attn_tau, mlp_tau=self.mlp_tau, keep_structure=self.keep_structure,
        )


def _unit_scale_copy(
    copied: nn.Module,
    example_inputs: Optional[Sequence[Any]],
    example_kwargs: Optional[Dict[str, Any]],
    settings: _Settings,
    training: bool,
) -> tuple[nn.Module, UnitScaleReport]:
    captured: Dict[str, Inputs] = {}
    given = example_inputs is not None or bool(example_kwargs)
    with _calls_replaced(copied, settings.replace):
        if given:
            captured = capture_inputs(copied, tuple(example_inputs or ()), example_kwargs)
        converter = settings.converter(captured)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)
            converted = converter.convert(copied, "")
    if (not given and not settings.keep_structure and isinstance(converted, fx.GraphModule)
            and not type(copied).__module__.startswith("torch.")):
        # The model's own object stays, for its attributes and methods (see call_structures).
        converted = keep_root(copied, converted, functools.partial(_convert_call, settings))
    converted.train(training)
    if settings.keep_structure:
        mark_converted(converted, "UnitScaled")
    return converted, converter.report


def _convert_call(settings: _Settings, module: nn.Module, inputs: Inputs) -> nn.Module:
    """`module`, whose layers are converted already, converted for one call's arguments."""
    converter = settings.converter({"": inputs})
    with _calls_replaced(module, settings.replace):
        converted = converter.convert(module, "")
    report = converter.report
    if report.unconverted or report.untraceable:
        warnings.warn("unit_scale left some ops of this call unscaled; they run as in the "
                      "original model:\n" + report.summary(), UnitScaleWarning, stacklevel=4)
    return converted


def _follow_placement(original: nn.Module, new: nn.Module) -> None:
    """A replacement takes the device and floating dtype of the module it replaces (built
    fresh, it would be float32 in a model already made half, on the CPU in one moved)."""
    tensors = [t for t in (*original.parameters(), *original.buffers()) if t.is_floating_point()]
    if tensors:
        new.to(device=tensors[0].device, dtype=tensors[0].dtype)


def _traced_as_call(target: Callable[..., Any]) -> Callable[..., Any]:
    """`target`, recorded as one call node when called on traced values."""
    def call(*args: Any, **kwargs: Any) -> Any:
        proxies = _proxies(args, kwargs)
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", target, args, kwargs)
        return target(*args, **kwargs)

    return call


def _proxies(args: Any, kwargs: Any) -> List[fx.Proxy]:
    found: List[fx.Proxy] = []

    def collect(value: Any) -> Any:
        if isinstance(value, fx.Proxy):
            found.append(value)
        return value

    fx.node.map_aggregate((args, kwargs), collect)
    return found


def _replaced(value: Any, replace: Dict[Callable[..., Any], Callable[..., Any]]) -> bool:
    return callable(value) and hashable(value) and value in replace


@contextlib.contextmanager
def _calls_replaced(model: nn.Module, replace: Dict[Callable[..., Any], Callable[..., Any]]
                    ) -> Iterator[None]:
    """While tracing `model`: each function in `replace` that a module's `forward` refers to,
    by a global name or a closure variable, is the traced call of its replacement instead."""
    restore: List[Callable[[], None]] = []
    try:
        if replace:
            for module in model.modules():
                forward = getattr(type(module).forward, "__func__", type(module).forward)
                for name, value in list(getattr(forward, "__globals__", {}).items()):
                    if _replaced(value, replace):
                        namespace = forward.__globals__
                        namespace[name] = _traced_as_call(replace[value])
                        restore.append(functools.partial(namespace.__setitem__, name, value))
                for cell in getattr(forward, "__closure__", None) or ():
                    try:
                        value = cell.cell_contents
                    except ValueError:  # an empty cell
                        continue
                    if _replaced(value, replace):
                        cell.cell_contents = _traced_as_call(replace[value])
                        restore.append(functools.partial(setattr, cell, "cell_contents", value))
        yield
    finally:
        for undo in reversed(restore):
            undo()


class _Converter:
    def __init__(
        self,
        captured: Dict[str, Inputs],
        skip: Set[ModuleKey],
        replacements: Dict[ModuleKey, Callable[[nn.Module], nn.Module]],
        functions: Dict[Any, Callable[..., Any]],
        attn_tau: float,
        mlp_tau: float,
        keep_structure: bool = False,
    ) -> None:
        self.captured = captured
        self.skip = skip
        self.replacements = replacements
        self.builtin = R.module_converters()
        self.functions = functions
        self.attn_tau = attn_tau
        self.mlp_tau = mlp_tau
        self.keep_structure = keep_structure
        self.report = UnitScaleReport()
        self._dropouts = 0
        # As traced: a function-turned-module (transformers 5) is recorded as its function.
        self.preserving = {function_behind(f) or f for f in R.scale_preserving_functions()}
        # id of a parameter of the original model -> its replacement, to keep ties.
        self._replaced_parameters: Dict[int, nn.Parameter] = {}

    # ------------------------------------------------------------ module policy

    def _skipped(self, module: nn.Module, name: str) -> bool:
        return name in self.skip or type(module) in self.skip

    def _module_converter(
        self, module: nn.Module, name: str
    ) -> Optional[Callable[[nn.Module], Optional[nn.Module]]]:
        if name in self.replacements:
            return self.replacements[name]
        return self.replacements.get(type(module)) or self.builtin.get(type(module))

    def _is_leaf(self, module: nn.Module, name: str) -> bool:
        if self._skipped(module, name) or self._module_converter(module, name) is not None:
            return True
        if isinstance(module, _UNIT_MODULES):
            return True
        is_torch = type(module).__module__.startswith(("torch.nn", "torch.ao.nn"))
        # torch layers without children are single ops; containers and transformer layers are
        # traced through so that their parts and residuals are converted.
        return is_torch and next(module.children(), None) is None

    # ------------------------------------------------------------ recursion

    def convert(self, module: nn.Module, name: str) -> nn.Module:
        if self._skipped(module, name) or isinstance(module, _UNIT_MODULES):
            return module
        make = self._module_converter(module, name)
        if make is not None:
            new = make(module)
            if new is None:
                self.report.unconverted.append(f"{name} ({type(module).__name__})")
                return module
            self.report.converted.append(name or type(module).__name__)
            _follow_placement(module, new)
            self._keep_ties(module, new)
            return new
        if self._is_leaf(module, name):
            if not isinstance(module, _NEUTRAL_MODULES):
                self.report.unconverted.append(f"{name} ({type(module).__name__})")
            return module
        if type(module).forward is nn.Module.forward:  # a container such as nn.ModuleList
            return self._convert_children(module, name)
        # Keeping the structure, a trunk calls its blocks as modules (see `keep_structure`).
        trunk = self.keep_structure and is_trunk(module)

        def is_leaf(child: nn.Module, child_name: str) -> bool:
            if trunk and is_trunk_leaf(module, child_name):
                return True
            return self._is_leaf(child, f"{name}.{child_name}" if name else child_name)

        label = name or type(module).__name__
        try:
            root, graph, specialised, tensor_nodes = trace_module(
                module, is_leaf, self.captured.get(name), autowrap=tuple(self.preserving)
            )
        except FailedAssertion:
            raise
        except Exception as error:  # any tracing failure: torch.export, else the children
            failure = f"{type(error).__name__}: {first_line(error)}"
            inputs = self.captured.get(name)
            if inputs is not None:
                exported = self._convert_exported(module, name, inputs, failure, trunk)
                if exported is not None:
                    return self._installed(module, exported)
            self.report.untraceable.append(f"{label}: {failure}")
            return self._convert_children(module, name)
        self.report.tracers.append(f"{label}: torch.fx")
        if specialised:
            self.report.specialised.append(f"{name or 'model'}: {', '.join(specialised)}")
        converted = self._rewrite(root, name, graph, tensor_nodes)
        if isinstance(root, ArgumentFrame):
            assert isinstance(converted, fx.GraphModule)
            converted = SpecialisedCall(converted, root)
        return self._installed(module, converted)

    def _installed(self, module: nn.Module, converted: nn.Module) -> nn.Module:
        """`converted`, or keeping the structure `module` with `converted` as its forward."""
        return install_forward(module, converted) if self.keep_structure else converted

    def _convert_exported(
        self, module: nn.Module, name: str, inputs: Inputs, fx_failure: str, trunk: bool = False
    ) -> Optional[nn.Module]:
        """Trace with torch.export after fx failed; None (and a note) if export fails too."""
        label = name or type(module).__name__
        unavailable = E.export_unavailable()
        if unavailable is not None:
            self.report.tracers.append(f"{label}: not traced ({unavailable})")
            return None

        def is_leaf(child: nn.Module, child_name: str) -> bool:
            return self._is_leaf(child, f"{name}.{child_name}" if name else child_name)

        try:
            trace = E.trace_with_export(module, inputs, is_leaf)
        except Exception as error:
            self.report.tracers.append(
                f"{label}: not traced (torch.fx: {fx_failure}; torch.export: "
                f"{type(error).__name__}: {first_line(error)})")
            return None
        inlined = inlined_blocks(module, trace.graph) if trunk else []
        if inlined:  # keeping the structure, its blocks must stay modules: convert them alone
            self.report.tracers.append(
                f"{label}: not traced (torch.fx: {fx_failure}; torch.export inlined "
                f"{', '.join(inlined)})")
            return None
        shapes = "dynamic" if trace.dynamic else "static"
        self.report.tracers.append(
            f"{label}: torch.export ({shapes} shapes; torch.fx failed with {fx_failure})")
        converted = self._rewrite(trace.root, name, trace.graph, trace.tensor_nodes,
                                  namer=E.module_path)
        for attribute, value in trace.attributes.items():
            setattr(converted, attribute, value)
        return SpecialisedCall(converted, trace.root, fixed_shapes=trace.fixed_shapes)

    def _keep_ties(self, original: nn.Module, new: nn.Module) -> None:
        """A parameter shared by several modules of the model is shared by their replacements."""
        for attribute, parameter in original.named_parameters(recurse=False):
            replacement = getattr(new, attribute, None)
            if not isinstance(replacement, nn.Parameter):
                continue
            tied = self._replaced_parameters.get(id(parameter))
            if tied is not None and tied.shape == replacement.shape:
                setattr(new, attribute, tied)
            else:
                self._replaced_parameters[id(parameter)] = replacement

    def _convert_children(self, module: nn.Module, name: str) -> nn.Module:
        for child_name, child in list(module.named_children()):
            qualified = f"{name}.{child_name}" if name else child_name
            setattr(module, child_name, self.convert(child, qualified))
        return module

    # ------------------------------------------------------------ graph rewriting

    def _rewrite(
        self, root: nn.Module, prefix: str, graph: fx.Graph, tensor_nodes: Optional[Set[str]],
        namer: Optional[Callable[[fx.Node], str]] = None,
    ) -> nn.Module:
        def where(node: fx.Node) -> str:
            local = node.name
            if namer is not None and namer(node):
                local = f"{namer(node)}.{node.name}"
            return f"{prefix}.{local}" if prefix else local

        def is_tensor(node: fx.Node) -> bool:
            if node.target in _INSERTED:  # made by this rewrite, after tracing
                return True
            if tensor_nodes is not None:
                return node.name in tensor_nodes
            # Traced without example inputs, a module's input is taken to be a tensor (a
            # block's input is the skip of its residuals).
            return node.op == "placeholder" or any(
                isinstance(a, fx.Node) for a in node.all_input_nodes)

        fuse_written_attention(root, graph, tensor_nodes)
        learned = learned_nodes(root, graph)
        self._fuse_silu_gates(graph, root, is_tensor, where)
        # An addition that no gradient flows through (transformers 4's masks) has no scale.
        without_gradient = set() if tensor_nodes is None else set(graph.nodes) - gradient_nodes(
            root, graph, is_tensor)
        self._rewrite_additions(graph, root, learned - without_gradient, is_tensor, where,
                                without_gradient)
        with_gradient = gradient_nodes(root, graph, is_tensor)
        converted_modules: Dict[str, nn.Module] = {}
        for node in list(graph.nodes):
            if node.op == "call_module":
                self._rewrite_module_call(root, prefix, node, converted_modules)
            elif node.op in ("call_function", "call_method"):
                if node.target in (R.unit_residual_add, R.unit_residual_branch, R.unit_add,
                                   R.unit_silu_glu):
                    continue
                if node not in with_gradient and tensor_nodes is not None:
                    continue  # built from buffers, shapes and integer inputs: no scale to keep
                self._rewrite_function_call(root, node, is_tensor, where)
        self._unit_initialise_direct_weights(root, graph)
        share_input_scales(root, graph)
        mark_attention_projections(root, graph)
        for node in reversed(list(graph.nodes)):  # else GraphModule would keep what they read
            if node.op == "get_attr" and not node.users:
                graph.erase_node(node)
        converted = fx.GraphModule(root, graph, class_name=f"UnitScaled{type(root).__name__}")
        # Shape checks resolved at trace time leave unused nodes behind.
        eliminate_dead_code(converted.graph)
        converted.graph.lint()
        converted.recompile()
        return converted

    def _rewrite_module_call(
        self, root: nn.Module, prefix: str, node: fx.Node, done: Dict[str, nn.Module]
    ) -> None:
        target = str(node.target)
        if isinstance(root, ArgumentFrame) and not target.startswith("inner."):
            return  # the frame's own helpers (torch.export's input guards)
        relative = target[len("inner."):] if isinstance(root, ArgumentFrame) else target
        qualified = f"{prefix}.{relative}" if prefix else relative
        if target in done:
            return
        module = root.get_submodule(target)
        traced_inputs = node.meta.pop("example_inputs", None)
        if self.keep_structure and traced_inputs is not None:
            # Converted on its own, the leaf is specialised to what the traced graph passes it.
            self.captured[qualified] = traced_inputs
        new = self.convert(module, qualified)
        done[target] = new
        if new is not module:
            set_submodule(root, target, new)

    def _rewrite_function_call(
        self, root: nn.Module, node: fx.Node, is_tensor: Callable[[fx.Node], bool],
        where: Callable[[fx.Node], str],
    ) -> None:
        target = node.target
        if hashable(target) and target in _DROPOUT:
            self._dropout_to_module(root, node, where)
            return
        adapter = self.functions.get(target) if hashable(target) else None
        if adapter is R.unit_scaled_dot_product_attention and self._attention_to_module(
                root, node, where):
            return
        if adapter is not None:
            node.op = "call_function"
            node.target = adapter
            self.report.converted.append(where(node))
            return
        if hashable(target) and (target in R.SHAPE_TARGETS or target in self.preserving
                                  or E.is_aten_shape_op(target)):
            return
        if hashable(target) and (target in _ADD or target in _SUB) or not is_tensor(node):
            if not is_tensor(node) or not has_tensor_input(node, is_tensor):
                return
        self.report.unconverted.append(f"{where(node)} ({target_name(target)})")

    def _attention_to_module(
        self, root: nn.Module, node: fx.Node, where: Callable[[fx.Node], str]
    ) -> bool:
        """Attention traced with dropout: a `UnitAttention` module, so eval() turns it off."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        arguments = dict(zip(names, node.args))
        arguments.update(node.kwargs)
        p = arguments.pop("dropout_p", 0.0)
        if isinstance(p, fx.Node) or not p:
            return False
        name = f"unit_attention_{self._dropouts}"
        self._dropouts += 1
        root.add_module(name, R.UnitAttention(float(p)))  # type: ignore[arg-type]
        node.op, node.target = "call_module", name
        node.args = tuple(arguments.pop(k) for k in ("query", "key", "value"))
        node.kwargs = arguments
        self.report.converted.append(where(node))
        return True

    def _dropout_to_module(
        self, root: nn.Module, node: fx.Node, where: Callable[[fx.Node], str]
    ) -> None:
        args = list(node.args) + [None] * 4
        p = node.kwargs.get("p", args[1] if args[1] is not None else 0.5)
        if isinstance(p, fx.Node):
            self.report.unconverted.append(f"{where(node)} (dropout with a traced p)")
            return
        name = f"unit_dropout_{self._dropouts}"
        self._dropouts += 1
        root.add_module(name, uu.Dropout(float(p)))  # type: ignore[arg-type]
        node.op, node.target = "call_module", name
        node.args, node.kwargs = (node.args[0] if node.args else node.kwargs["input"],), {}
        self.report.converted.append(where(node))

    def _rewrite_additions(
        self, graph: fx.Graph, root: nn.Module, learned: Set[fx.Node],
        is_tensor: Callable[[fx.Node], bool], where: Callable[[fx.Node], str],
        without_gradient: Set[fx.Node],
    ) -> None:
        for node in list(graph.nodes):
            is_add = node.op in ("call_function", "call_method") and hashable(node.target) and (
                node.target in _ADD or node.target in _SUB
            )
            if not is_add or len(node.args) != 2 or not is_tensor(node) or (
                    node in without_gradient):
                continue
            left, right = node.args
            if not (isinstance(left, fx.Node) and isinstance(right, fx.Node)) or left is right:
                continue
            alpha = node.kwargs.get("alpha", 1)
            subtract = node.target in _SUB
            skip_node, branch_node = residual_operands(left, right, is_tensor)
            if skip_node is not None and branch_node is not None and alpha == 1 and not subtract:
                branch = nodes_between(skip_node, node)
                if any(has_weights(root, n) for n in branch):
                    self._make_residual(graph, root, node, skip_node, branch_node, branch)
                    self.report.residuals.append(where(node))
                    continue
            if left in learned and right in learned:
                node.op, node.target = "call_function", (R.unit_sub if subtract else R.unit_add)
                node.kwargs = {"alpha": alpha}
                self.report.converted.append(where(node))
            else:
                self.report.unconverted.append(
                    f"{where(node)} ({'sub' if subtract else 'add'} of a tensor without weights)"
                )

    def _fuse_silu_gates(
        self, graph: fx.Graph, root: nn.Module, is_tensor: Callable[[fx.Node], bool],
        where: Callable[[fx.Node], str],
    ) -> None:
        """`x * silu(g)` (either order), silu used nowhere else: one `U.silu_glu(x, g)`."""
        for node in list(graph.nodes):
            is_mul = node.op in ("call_function", "call_method") and hashable(node.target) \
                and node.target in _MUL
            if not is_mul or len(node.args) != 2 or node.kwargs:
                continue
            for gated, other in (node.args, tuple(reversed(node.args))):
                if not (isinstance(gated, fx.Node) and isinstance(other, fx.Node)):
                    continue
                gate = silu_input(root, gated)
                if gate is None or len(gated.users) != 1 or not is_tensor(other):
                    continue
                node.op, node.target = "call_function", R.unit_silu_glu
                node.args, node.kwargs = (other, gate), {}
                graph.erase_node(gated)
                self.report.converted.append(f"{where(node)} (silu-gated product)")
                break

    def _make_residual(
        self, graph: fx.Graph, root: nn.Module, join: fx.Node, skip_node: fx.Node,
        branch_node: fx.Node, branch: Set[fx.Node],
    ) -> None:
        tau = self.attn_tau if any(is_attention(root, n) for n in branch) else self.mlp_tau
        entries = [user for user in skip_node.users if user in branch]
        first = min(entries, key=node_order(graph))
        with graph.inserting_before(first):
            branch_input = graph.call_function(R.unit_residual_branch, (skip_node, tau))
        for user in entries:
            user.replace_input_with(skip_node, branch_input)
        join.op, join.target = "call_function", R.unit_residual_add
        join.args, join.kwargs = (branch_node, skip_node, tau), {}

    def _unit_initialise_direct_weights(self, root: nn.Module, graph: fx.Graph) -> None:
        """Weights a converted function reads straight from an attribute: unit init."""
        weight_positions: Dict[Any, Any] = {
            R.unit_linear: (1, 2), R.unit_embedding: (1, None), R.unit_addmm: (2, 0),
            **E.ATEN_WEIGHT_POSITIONS,
        }
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in weight_positions:
                continue
            weight_at, bias_at = weight_positions[node.target]
            for position, init in ((weight_at, nn.init.normal_), (bias_at, nn.init.zeros_)):
                if position is None or position >= len(node.args):
                    continue
                arg = node.args[position]
                if isinstance(arg, fx.Node) and arg.op == "get_attr":
                    value = read_attribute(root, str(arg.target))
                    if isinstance(value, nn.Parameter):
                        with torch.no_grad():
                            init(value)
