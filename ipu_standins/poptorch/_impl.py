"""``poptorch._impl``: the IPU context flag, PopTorch's Python errors, the pre- and post-compile
hooks and the wrapping of a trained model (its class is swapped for a subclass that copies the
weights back from the "device" before they are read, as PopTorch does)."""
from __future__ import annotations

import collections
import contextlib
import copy
import copyreg
import weakref
from typing import Any, Callable, Dict, Iterator, List

import torch

from . import _state
from .poptorch_core import Error

__all__ = ["isRunningOnIpu", "setIpuContext", "createPoptorchError", "isDispatchTracing",
           "isWrapped", "unwrapIfWrapped", "wrap_trained_model", "unwrapModelIfNecessary",
           "rewrapModelIfNecessary",
           "_restoreWrapperIfNecessary", "registerPreCompileHook", "registerPostCompileHook",
           "compile_hooks"]


def createPoptorchError(message: str) -> Error:
    kind = "poptorch_py_error"
    error = Error(f"'{kind}': {message}")
    error.type = kind
    error.message = message
    return error


def isRunningOnIpu() -> bool:
    """True while a PopTorch model traces or runs its ``forward`` (never on the host)."""
    return _state.ON_IPU


def setIpuContext(value: bool) -> None:
    _state.ON_IPU = value


def isDispatchTracing() -> bool:
    return _state.ON_IPU


_wrapper_types: List[type] = []
# The wrapper each unwrapped object had, by the object's identity, for as long as it lives. (A
# WeakKeyDictionary compares its keys with ==, which for tensors is elementwise: PopTorch keeps
# its own registry by address for the same reason.)
_unwrapped: Dict[int, type] = {}


def _remember_wrapper(obj: Any, wrapper: type) -> None:
    key = id(obj)
    if key not in _unwrapped:
        try:
            weakref.finalize(obj, _unwrapped.pop, key, None)
        except TypeError:  # not weakly referenceable: nothing to remember it by
            return
    _unwrapped[key] = wrapper


def isWrapped(obj: Any) -> bool:
    return isinstance(obj, tuple(_wrapper_types))


def unwrapIfWrapped(obj: Any) -> Any:
    if isWrapped(obj):
        obj.__class__ = obj.__class__.__bases__[0]
    return obj


def _restoreWrapperIfNecessary(obj: Any) -> Any:
    wrapper = _unwrapped.get(id(obj))
    if wrapper is not None:
        obj.__class__ = wrapper
    return obj


def _unwrap_and_register(obj: Any) -> None:
    if isWrapped(obj):
        wrapper = type(obj)
        obj.__class__ = wrapper.__bases__[0]
        _remember_wrapper(obj, wrapper)


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Unwrap the model, its parameters and its buffers, remembering their wrappers for
    :func:`rewrapModelIfNecessary` (Optimum's seq2seq trainer unwraps a trained model before
    it compiles the same modules for generation)."""
    for tensor in list(model.buffers()) + list(model.parameters()):
        _unwrap_and_register(tensor)
    _unwrap_and_register(model)


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:
    """Give back the wrappers :func:`unwrapModelIfNecessary` took from the model, its
    parameters and its buffers."""
    for tensor in list(model.buffers()) + list(model.parameters()):
        _restoreWrapperIfNecessary(tensor)
    _restoreWrapperIfNecessary(model)


def _pickle_unwrapped(obj: Any) -> Any:
    """A wrapped model pickles as its own class (loadable without PopTorch)."""
    wrapper = type(obj)
    obj.__class__ = wrapper.__bases__[0]
    try:
        clone = copy.copy(obj)
    finally:
        obj.__class__ = wrapper
    return copy.copy, (clone,)


def _plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor (or parameter) sharing its storage."""
    data = torch.Tensor._make_subclass(torch.Tensor, tensor.detach(), False)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(data, tensor.requires_grad)
    return data.requires_grad_(tensor.requires_grad)


def _tensor_reduce(tensor: torch.Tensor) -> Any:
    """A wrapped parameter or buffer pickles, and copies, through a plain one's own reduce:
    a file it is saved in names only the globals of plain tensors, which ``torch.load``'s
    weights-only reader (its default since torch 2.6) accepts."""
    return _plain_tensor(tensor).__reduce_ex__(2)


def wrap_trained_model(model: torch.nn.Module, sync: Callable[[], bool],
                       version: Callable[[], Any], destroy: Callable[[], None]) -> None:
    """Swap the classes of ``model``, its parameters and its buffers for subclasses whose
    reads first call ``sync`` (the executor's ``copyWeightsToHostIfNeeded``), as PopTorch
    does, so that the trained weights reach the host when the host reads them."""
    base = type(model)

    class PoptorchParameter(torch.nn.Parameter):
        def __getattribute__(self, name: str) -> Any:
            sync()
            return object.__getattribute__(self, name)

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return super().__torch_function__(func, types, args, kwargs or {})

    class PoptorchBuffer(torch.Tensor):
        def __getattribute__(self, name: str) -> Any:
            sync()
            return super().__getattribute__(name)

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            return super().__torch_function__(func, types, args, kwargs or {})

    class PoptorchModel(base):  # type: ignore[misc, valid-type]
        def copyWeightsToHostIfNeeded(self) -> bool:
            return sync()

        def destroy(self) -> None:
            destroy()

        def __getattribute__(self, name: str) -> Any:
            if name == "_host_weights_version":
                return version()
            if name in ("_buffers", "_parameters", "forward"):
                sync()
            return object.__getattribute__(self, name)

        def __getattr__(self, name: str) -> Any:
            value = super().__getattr__(name)
            if isinstance(value, torch.nn.Parameter):
                sync()
            return value

        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            """The model's state with every wrapped entry as a plain tensor sharing its
            storage, as PopTorch returns it (loadable where PopTorch is not installed)."""
            sync()
            state = base.state_dict(self, *args, **kwargs)
            plain: Dict[int, torch.Tensor] = {}
            for key, value in state.items():
                if isWrapped(value):
                    state[key] = plain.setdefault(id(value), _plain_tensor(value))
            return state

    PoptorchModel.__name__ = base.__name__
    PoptorchModel.__qualname__ = base.__qualname__
    for kind in (PoptorchModel, PoptorchParameter, PoptorchBuffer):
        _wrapper_types.append(kind)
    copyreg.pickle(PoptorchModel, _pickle_unwrapped)
    copyreg.pickle(PoptorchParameter, _tensor_reduce)
    copyreg.pickle(PoptorchBuffer, _tensor_reduce)
    for parameter in model.parameters():
        if type(parameter) is torch.nn.Parameter:
            parameter.__class__ = PoptorchParameter
    for buffer in model.buffers():
        if type(buffer) is torch.Tensor:
            buffer.__class__ = PoptorchBuffer
    model.__class__ = PoptorchModel


def unwrap_model(model: torch.nn.Module) -> None:
    """Undo :func:`wrap_trained_model` (``destroy()``)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if isWrapped(tensor):
            tensor.__class__ = type(tensor).__bases__[0]
    unwrapModelIfNecessary(model)


# Every model's compilation runs these, in the order they were registered.
_PRECOMPILE_HOOKS: Dict[int, Callable[[], None]] = collections.OrderedDict()
_POSTCOMPILE_HOOKS: Dict[int, Callable[[], None]] = collections.OrderedDict()


def _register_hook(hooks: Dict[int, Callable[[], None]], hook: Any, kind: str
                   ) -> torch.utils.hooks.RemovableHandle:
    if not callable(hook):
        raise RuntimeError(f"{kind}-compile hook must be callable")
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], None]) -> torch.utils.hooks.RemovableHandle:
    """Run ``hook()`` before each model's compilation; ``handle.remove()`` unregisters it."""
    return _register_hook(_PRECOMPILE_HOOKS, hook, "Pre")


def registerPostCompileHook(hook: Callable[[], None]) -> torch.utils.hooks.RemovableHandle:
    """Run ``hook()`` after each model's compilation (also one that failed);
    ``handle.remove()`` unregisters it."""
    return _register_hook(_POSTCOMPILE_HOOKS, hook, "Post")


@contextlib.contextmanager
def compile_hooks() -> Iterator[None]:
    """Run the pre-compile hooks, then the compilation, then the post-compile hooks (also
    after a failed compilation, as PopTorch)."""
    for hook in list(_PRECOMPILE_HOOKS.values()):
        hook()
    try:
        yield
    finally:
        for hook in list(_POSTCOMPILE_HOOKS.values()):
            hook()
