"""`analyse_module`: a module's forward code, each line annotated with the standard deviation
of the tensor it computes and of that tensor's gradient (unit_scaling's helper).

The module is traced with torch.fx through every submodule; this package's unit-scaled ops
(`U.linear`, ...) stay single calls, shown as `U.<name>`. For per-tensor tables over a training
step, see :mod:`ipu_unit_scaling.analysis`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple, Union, cast

import torch
from torch import Tensor, fx, nn

from .. import ops as functional

__all__ = ["ScalePair", "ScaleDict", "ScaleTracker", "ScaleTrackingInterpreter",
           "analyse_module"]


@dataclass
class ScalePair:
    """The standard deviation of a tensor in the forward pass and of its gradient."""

    forward: Optional[float] = None
    backward: Optional[float] = None

    def __str__(self) -> str:
        forward = "n/a" if self.forward is None else f"{self.forward:.3}"
        backward = "n/a" if self.backward is None else f"{self.backward:.3}"
        return f"(-> {forward}, <- {backward})"


# Each node's name -> its tensor's scales, in the order the nodes ran.
ScaleDict = Dict[str, ScalePair]


class ScaleTracker(torch.autograd.Function):
    """The identity, recording its input's standard deviation in a `ScalePair`'s `forward`
    and its gradient's in its `backward`."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, pair: ScalePair) -> Tensor:
        pair.forward = float(t.detach().std())
        ctx.pair = pair
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        ctx.pair.backward = float(grad.std())
        return grad, None

    @staticmethod
    def track(t: Tensor, pair: ScalePair) -> Tensor:
        """`t`, its scales recorded in `pair`."""
        return cast(Tensor, ScaleTracker.apply(t, pair))


class ScaleTrackingInterpreter(fx.Interpreter):
    """Runs a graph module, recording the scales of every floating-point tensor a node
    computes (and, after a backward pass, of its gradient) in `scales`."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.scales: ScaleDict = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, Tensor) and out.is_floating_point() and n.op != "output":
            pair = self.scales[n.name] = ScalePair()
            out = ScaleTracker.track(out, pair)
        return out


class _DeepTracer(fx.Tracer):
    def __init__(self, recurse_modules: bool, autowrap_modules: Tuple[ModuleType, ...],
                 autowrap_functions: Tuple[Callable[..., Any], ...]) -> None:
        super().__init__(autowrap_modules=autowrap_modules,  # type: ignore[arg-type]
                         autowrap_functions=autowrap_functions)
        self.recurse_modules = recurse_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not self.recurse_modules

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any,
                    name: Optional[str] = None, type_expr: Optional[Any] = None) -> fx.Node:
        if isinstance(type_expr, str):  # a postponed annotation: shown as written
            type_expr = _Annotation.of(type_expr)
        return super().create_node(kind, target, args, kwargs, name, type_expr)


class _Annotation:
    """An annotation kept as its source text (fx would otherwise quote and mangle it)."""

    _known: Dict[str, _Annotation] = {}

    def __init__(self, text: str) -> None:
        self.text = text

    @classmethod
    def of(cls, text: str) -> _Annotation:
        """One object per text: fx names each distinct object once in the generated code."""
        return cls._known.setdefault(text, cls(text))

    def __repr__(self) -> str:
        return self.text


def _short_names(code: str) -> str:
    """fx's global names of the unit-scaled ops (`ipu_unit_scaling_functional_linear`) as
    `U.linear`."""
    for name in functional.__all__:
        op = getattr(functional, name)
        qualified = re.sub(r"[^0-9a-zA-Z_]", "_", f"{op.__module__}.{op.__name__}")
        code = re.sub(rf"\b{qualified}\b", f"U.{name}", code)
    return code


def _annotate(code: str, scales: Dict[str, ScalePair]) -> str:
    lines = []
    for line in code.splitlines():
        if not line.strip() or line.startswith("torch.fx._symbolic_trace.wrap"):
            continue
        statement = line.split(";")[0]
        words = statement.split()
        if words and words[0] in scales:
            statement = f"{statement};  {scales[words[0]]}"
        lines.append(statement)
    return "\n".join(lines).strip()


def analyse_module(
    module: nn.Module,
    inputs: Union[Tensor, Tuple[Tensor, ...]],
    backward: Optional[Tensor] = None,
    recurse_modules: bool = True,
    syntax_highlight: bool = True,
    autowrap_modules: Tuple[ModuleType, ...] = (math, functional),
    autowrap_functions: Tuple[Callable[..., Any], ...] = (),
) -> str:
    """`module`'s forward as code, each tensor annotated `(-> forward std, <- gradient std)`
    after one forward pass on `inputs` and one backward pass of `backward` (or of `backward()`
    for a scalar output).

    `recurse_modules=False` keeps submodules as single calls; `autowrap_modules` and
    `autowrap_functions` are recorded as single calls instead of traced through (by default
    `math` and the unit-scaled ops). `syntax_highlight` colours the code for a terminal where
    Pygments is installed.
    """
    tracer = _DeepTracer(recurse_modules, autowrap_modules, autowrap_functions)
    graph = tracer.trace(module)
    graph_module = fx.GraphModule(tracer.root, graph)
    recorder = ScaleTrackingInterpreter(graph_module)
    output = recorder.run(*(inputs if isinstance(inputs, tuple) else (inputs,)))
    output.backward(backward)
    code = _annotate(_short_names(graph_module.code), recorder.scales)
    if syntax_highlight:
        try:
            from pygments import highlight
            from pygments.formatters import TerminalFormatter
            from pygments.lexers import PythonLexer
        except ImportError:
            return code
        return str(highlight(code, PythonLexer(), TerminalFormatter()))
    return code
