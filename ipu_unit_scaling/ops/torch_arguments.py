"""Arguments the unit-scaled ops and modules take for torch's sake but do not implement.

The ops and modules mirror torch's signatures, so code written for torch calls them unchanged;
an argument whose unit-scaled version is not implemented (`sparse` gradients, an in-place
dropout) is refused when given a value other than its default, in one clear line.
`unsupported(*names)` marks a function or a module's `__init__` so.

unit-scaling's docstring helpers (its ``unit_scaling.docs`` path) are here too, for ops written
the way it writes them: `docstring_from(torch_function, ...)` and `inherit_docstring(...)` take
torch's docstring, with a new first line, added arguments and the unsupported ones marked (and
refused), `format_docstring` fills a docstring's ``{}`` fields, and the argument lines it
shares between ops (`mult_docstring`, the constraint arguments).
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, Iterable, List, Optional, Type, TypeVar

from torch import Tensor

__all__ = ["unsupported", "T", "docstring_from", "inherit_docstring", "format_docstring",
           "mult_docstring", "binary_constraint_docstring", "ternary_constraint_docstring",
           "variadic_constraint_docstring"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, Tensor) or isinstance(default, Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:  # a value that cannot be compared is not the default
        return False


def validate_arguments(f: F, unsupported_args: Iterable[str] = ()) -> F:
    """`f`, refusing a non-default value of any argument named in `unsupported_args`.

    ValueError at once for a name that is not an argument of `f` or has no default.
    """
    names = list(unsupported_args)
    if not names:
        return f
    signature = inspect.signature(f)
    for name in names:
        parameter = signature.parameters.get(name)
        if parameter is None:
            raise ValueError(f"unsupported argument {name!r} is not valid: {f.__qualname__} "
                             "has no such argument")
        if parameter.default is inspect.Parameter.empty:
            raise ValueError(f"unsupported argument {name!r} of {f.__qualname__} has no default "
                             "value to compare with")
    defaults = {name: signature.parameters[name].default for name in names}

    @functools.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs).arguments
        for name, default in defaults.items():
            if name in given and not _is_default(given[name], default):
                value = given[name]
                shown = (f"<tensor {tuple(value.shape)}>" if isinstance(value, Tensor)
                         else repr(value))
                raise ValueError(f"{f.__qualname__}: the {name!r} argument has not been "
                                 f"implemented for the unit-scaled version (given {shown}, "
                                 f"only {default!r} is)")
        return f(*args, **kwargs)

    return checked  # type: ignore[return-value]


def unsupported(*names: str) -> Callable[[F], F]:
    """Decorator: refuse non-default values of the arguments `names` (see `validate_arguments`)."""
    return functools.partial(validate_arguments, unsupported_args=names)  # type: ignore[return-value]


_UNSUPPORTED_MARK = "**[not supported by ipu-unit-scaling]** "


def _edited_docstring(target: Any, short_description: Optional[str],
                      add_args: Optional[List[str]], unsupported_args: Iterable[str]) -> str:
    """`target`'s docstring with its first paragraph replaced, the unsupported arguments'
    descriptions marked, and `add_args` (each ``name (type): description``) appended to its
    ``Args:`` section (made if it has none)."""
    lines = (inspect.getdoc(target) or "").splitlines()
    if short_description is not None:
        end = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
        lines = [short_description] + lines[end:]
    unsupported = set(unsupported_args)
    for i, line in enumerate(lines):
        named = re.match(r"^(\s+)(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if named and named.group(2) in unsupported:
            indent, name, kind, text = named.groups()
            lines[i] = f"{indent}{name}{' ' + kind if kind else ''}: {_UNSUPPORTED_MARK}{text}"
    if add_args:
        start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
        if start is None:
            lines += ["", "Args:"]
            start = len(lines) - 1
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
            end += 1
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1
        lines[end:end] = [f"    {argument}" for argument in add_args]
    return "\n".join(lines)


def docstring_from(target: Callable[..., Any], short_description: Optional[str] = None,
                   add_args: Optional[List[str]] = None, unsupported_args: Iterable[str] = ()
                   ) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: the function takes `target`'s docstring, edited (a new first paragraph,
    `add_args` appended to its arguments, `unsupported_args` marked), and refuses non-default
    values of `unsupported_args` (see `validate_arguments`)."""
    names = list(unsupported_args)

    def decorate(source: Callable[..., T]) -> Callable[..., T]:
        source.__doc__ = _edited_docstring(target, short_description, add_args, names)
        return validate_arguments(source, names)

    return decorate


def inherit_docstring(short_description: Optional[str] = None,
                      add_args: Optional[List[str]] = None, unsupported_args: Iterable[str] = ()
                      ) -> Callable[[Type[T]], Type[T]]:
    """Class decorator: the class takes its first base's docstring, edited as
    `docstring_from` edits it, and its ``__init__`` refuses non-default values of
    `unsupported_args`."""
    names = list(unsupported_args)

    def decorate(cls: Type[T]) -> Type[T]:
        cls.__doc__ = _edited_docstring(cls.mro()[1], short_description, add_args, names)
        cls.__init__ = validate_arguments(cls.__init__, names)  # type: ignore[method-assign]
        return cls

    return decorate


def format_docstring(*args: str) -> Callable[[T], T]:
    """Decorator: the object's docstring with its ``{}`` fields filled by `args`
    (``str.format``)."""

    def decorate(obj: T) -> T:
        if isinstance(obj.__doc__, str):
            obj.__doc__ = obj.__doc__.format(*args)
        return obj

    return decorate


def _constraint_docstring(names: str) -> str:
    return ("constraint (Optional[str], optional): how the scales are tied, one of "
            f"[None, 'gmean', 'hmean', 'amean', 'to_output_scale'{names}] (see "
            "`ipu_unit_scaling.constraints`).")


# The `constraint` argument of an op with one input, two inputs, or any number of them.
binary_constraint_docstring = _constraint_docstring(", 'to_grad_input_scale'")
ternary_constraint_docstring = _constraint_docstring(
    ", 'to_left_grad_scale', 'to_right_grad_scale'")
variadic_constraint_docstring = _constraint_docstring("")


def mult_docstring(name: str = "mult") -> str:
    """The documentation line of a nonlinearity's shape multiplier argument `name`."""
    return (f"{name} (float, optional): multiplies the nonlinearity's input, changing its "
            "shape: above 1 sharper (a lower temperature), below 1 flatter.")
