"""Arguments the unit-scaled ops and modules take for torch's sake but do not implement.

The ops and modules mirror torch's signatures, so code written for torch calls them unchanged;
an argument whose unit-scaled version is not implemented (`sparse` gradients, an in-place
dropout) is refused when given a value other than its default, in one clear line.
`unsupported(*names)` marks a function or a module's `__init__` so.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, TypeVar

from torch import Tensor

__all__ = ["unsupported"]

F = TypeVar("F", bound=Callable[..., Any])


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
