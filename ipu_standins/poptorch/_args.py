"""How a PopTorch model's call arguments are bound to ``forward``'s parameters, flattened to
tensors, and checked against the call that compiled the model (PopTorch's
``python/_args_parser.py``: after compiling, inputs of other types, shapes or values are
refused, until ``destroy()``)."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._impl import createPoptorchError

__all__ = ["Args", "ArgsParser", "flatten", "rebuild", "CUSTOM_PARSERS", "down_cast"]

# type -> parser with yieldTensors(obj) and reconstruct(obj, tensors)
CUSTOM_PARSERS: Dict[type, Any] = {}

_AFTER = ("\nThis error occurred because the inputs passed at runtime don't match the inputs "
          "used to compile the model.\nTo recompile the model for the new inputs create a new "
          "inferenceModel / trainingModel wrapper or call destroy() on the curent one and try "
          "again.")


def _parser_for(value: Any) -> Optional[Any]:
    for kind in type(value).__mro__:
        if kind in CUSTOM_PARSERS:
            return CUSTOM_PARSERS[kind]
    return None


def flatten(value: Any) -> List[torch.Tensor]:
    """The tensors of a structure of tuples, lists, dicts and registered custom types."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in flatten(item)]
    parser = _parser_for(value)
    if parser is not None:
        return [t for t in parser.yieldTensors(value) if isinstance(t, torch.Tensor)]
    return []


def flatten_like(value: Any, template: Any) -> List[torch.Tensor]:
    """The tensors of ``value`` in the order of ``template``'s structure (dict keys in the
    template's order, as PopTorch packs inputs by the compiled call's structure)."""
    if isinstance(value, dict) and isinstance(template, dict) and set(value) == set(template):
        return [t for key in template for t in flatten_like(value[key], template[key])]
    if isinstance(value, (tuple, list)) and isinstance(template, (tuple, list)) and len(
            value) == len(template):
        return [t for v, c in zip(value, template) for t in flatten_like(v, c)]
    return flatten(value)


def rebuild(value: Any, tensors: List[torch.Tensor]) -> Any:
    """``value`` with its tensors replaced, in order, by ``tensors`` (consumed)."""
    if isinstance(value, torch.Tensor):
        return tensors.pop(0)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(rebuild(v, tensors) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(rebuild(v, tensors) for v in value)
    if isinstance(value, dict):
        rebuilt = type(value)() if type(value) is not dict else {}
        for key, item in value.items():
            rebuilt[key] = rebuild(item, tensors)
        return rebuilt
    parser = _parser_for(value)
    if parser is not None:
        count = len([t for t in parser.yieldTensors(value) if isinstance(t, torch.Tensor)])
        mine = [tensors.pop(0) for _ in range(count)]
        return parser.reconstruct(value, iter(mine))
    return value


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    return rebuild(value, [fn(t) for t in flatten(value)])


class Args:
    """Positional arguments (with their parameter names) and named ones."""

    def __init__(self) -> None:
        self.args: List[Any] = []
        self.arg_names: List[str] = []
        self.kwargs: Dict[str, Any] = {}

    def map(self, fn: Callable[[torch.Tensor], Any]) -> Args:
        other = Args()
        other.args = [map_tensors(a, fn) for a in self.args]
        other.arg_names = list(self.arg_names)
        other.kwargs = {k: map_tensors(v, fn) for k, v in self.kwargs.items()}
        return other

    def tensors(self) -> List[torch.Tensor]:
        return flatten(self.args) + flatten(self.kwargs)

    def tensors_like(self, template: Args) -> List[torch.Tensor]:
        return flatten_like(self.args, template.args) + flatten_like(self.kwargs, template.kwargs)

    def with_tensors(self, tensors: List[torch.Tensor]) -> Tuple[List[Any], Dict[str, Any]]:
        pool = list(tensors)
        args = [rebuild(a, pool) for a in self.args]
        kwargs = {k: rebuild(v, pool) for k, v in self.kwargs.items()}
        return args, kwargs

    def validate(self, inputs: Args) -> None:
        """Refuse ``inputs`` unless they match these (the compiled call's) arguments."""
        if len(inputs.args) != len(self.args):
            raise createPoptorchError(
                f"Number of positional arguments mismatch: expected {len(self.args)} "
                f"arguments but got {len(inputs.args)}.{_AFTER}")
        for name, compiled, given in zip(self.arg_names, self.args, inputs.args):
            _validate(name, compiled, given)
        _validate("named arguments", self.kwargs, inputs.kwargs, named=True)


def _validate(name: str, compiled: Any, given: Any, named: bool = False) -> None:
    if type(compiled) is not type(given):
        raise createPoptorchError(
            f"Type mismatch for {name}: expected {type(compiled)} but got {type(given)}.{_AFTER}")
    if isinstance(compiled, (tuple, list)):
        if len(compiled) != len(given):
            raise createPoptorchError(f"Length mismatch for {name}: expected {len(compiled)} "
                                      f"elements but got {len(given)}.{_AFTER}")
        for index, (c, g) in enumerate(zip(compiled, given)):
            _validate(f"{name}[{index}]", c, g)
    elif isinstance(compiled, dict):
        expected, provided = set(compiled), set(given)
        if expected != provided:
            details = []
            if provided - expected:
                details.append("Unexpected arguments: " + ", ".join(sorted(provided - expected)))
            if expected - provided:
                details.append("Missing arguments: " + ", ".join(sorted(expected - provided)))
            raise createPoptorchError(f"Keys mismatch for {name}: {'. '.join(details)}.{_AFTER}")
        for key, value in compiled.items():
            _validate(key if named else f"{name}[{key}]", value, given[key])
    elif isinstance(compiled, torch.Tensor):
        if compiled.dtype != given.dtype:
            raise createPoptorchError(f"Data type mismatch for {name}: expected "
                                      f"{compiled.dtype} but got {given.dtype}.{_AFTER}")
        if compiled.shape != given.shape:
            raise createPoptorchError(f"Shape mismatch for {name}: expected {compiled.shape} "
                                      f"but got {given.shape}.{_AFTER}")
    else:
        compiled_tensors = flatten(compiled)
        if compiled_tensors:
            _validate(name, tuple(compiled_tensors), tuple(flatten(given)))
        elif compiled != given:
            raise createPoptorchError(
                f"Value mismatch for {name}: expected {compiled} but got {given}.{_AFTER}")


class ArgsParser:
    """Binds a call's ``args``/``kwargs`` to the parameters of ``model.forward``."""

    def __init__(self, model: Any) -> None:
        target = model.forward if isinstance(model, torch.nn.Module) else model
        try:
            signature: Optional[inspect.Signature] = inspect.signature(target)
        except (TypeError, ValueError):
            signature = None
        if signature is None:
            self._names = ["args", "kwargs"]
            self._kinds: List[Any] = [inspect.Parameter.VAR_POSITIONAL,
                                      inspect.Parameter.VAR_KEYWORD]
            self._defaults: Dict[str, Any] = {}
        else:
            self._names = list(signature.parameters)
            self._kinds = [p.kind for p in signature.parameters.values()]
            self._defaults = {n: p.default for n, p in signature.parameters.items()
                              if p.default is not inspect.Parameter.empty}
        self._variadic = any(k in (inspect.Parameter.VAR_POSITIONAL,
                                   inspect.Parameter.VAR_KEYWORD) for k in self._kinds)

    def __call__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Args:
        bound = Args()
        assert self._variadic or len(args) + len(kwargs) <= len(self._names), (
            f"Too many arguments provided: expected {self._names} ({len(self._names)}) "
            f"but got {len(args) + len(kwargs)}")
        if not self._variadic:
            for key in kwargs:
                assert key in self._names, (
                    f"{key} is not a valid parameter.Allowed values are {self._names}")
        remaining = list(args)
        after_variadic = False
        for index, (name, kind) in enumerate(zip(self._names, self._kinds)):
            if kind == inspect.Parameter.VAR_KEYWORD:
                for key, value in kwargs.items():
                    if key not in self._names[:index]:
                        bound.kwargs[key] = value
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                after_variadic = True
                for position, value in enumerate(remaining[index:]):
                    bound.args.append(value)
                    bound.arg_names.append(f"*{name}[{position}]")
                remaining = remaining[:index]
            elif index < len(remaining):
                assert name not in kwargs, f"Parameter {name} was passed more than once"
                bound.args.append(remaining[index])
                bound.arg_names.append(name)
            elif name in kwargs or name in self._defaults:
                if name not in kwargs and after_variadic:
                    bound.kwargs[name] = self._defaults[name]
                    continue
                value = kwargs[name] if name in kwargs else self._defaults[name]
                if after_variadic or kind == inspect.Parameter.KEYWORD_ONLY:
                    bound.kwargs[name] = value
                else:
                    bound.args.append(value)
                    bound.arg_names.append(name)
            else:
                raise createPoptorchError(f"Mandatory parameter {name} missing")
        return bound.map(lambda t: t if t.is_contiguous() else t.contiguous())


def down_cast(tensor: torch.Tensor) -> torch.Tensor:
    """An input as PopTorch adds it to the graph: the IPU has no float64, so doubles become
    float32 (``downCastIfNeeded``)."""
    return tensor.float() if tensor.dtype == torch.float64 else tensor
