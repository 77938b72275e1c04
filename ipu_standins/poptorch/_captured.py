"""Functions a program compiled with TorchDynamo, called inside ``forward`` while the stand-in
traces.

PopTorch traces through its dispatcher, so a ``torch.compile``'d function (a graph transform
that captures the model's forward, as unit-scaling's do) is captured by TorchDynamo as on the
host, and what its backend returns runs on the IPU's tensors: PopTorch records the ops it
calls. The stand-in traces with ``make_fx``, inside which TorchDynamo refuses to compile ("using
FX to symbolically trace a dynamo-optimized function"); :func:`dynamo_compiles_inside_trace`
lets it compile there (where torch has ``force_compile_during_fx_trace``), so that the
backend's graph is what the trace records, as on PopTorch. Elsewhere the refusal stands.

TorchDynamo captures the program's own calls: the trace's rules step aside while it compiles
(:func:`compiling`; the rules' dispatch mode ignores compile internals), and meet each op of the
compiled artifact as it runs, as PopTorch's dispatcher meets the ops of what the backend returns.
On an IPU every tensor TorchDynamo sees is on the IPU, so a device ``"ipu"`` in the program
changes nothing; the stand-in traces on the CPU, so :func:`without_ipu_devices` leaves such
arguments out of the captured call (``x.to("ipu")`` is ``x.to()``, ``torch.ones(n,
device="ipu")`` is made where the trace makes factories' tensors: on the IPU).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Iterator, Sequence, Tuple

import torch

from ._devices import names_ipu

__all__ = ["call_as_captured", "compiling", "dynamo_compiles_inside_trace",
           "without_ipu_devices"]


def compiling() -> bool:
    """Whether TorchDynamo is capturing the code that asks (torch 2.0's has no such question:
    False)."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


@contextlib.contextmanager
def dynamo_compiles_inside_trace() -> Iterator[None]:
    """Inside it, a TorchDynamo-compiled function called during the trace compiles and runs its
    backend's graph (where the program has imported TorchDynamo and its torch can)."""
    dynamo = sys.modules.get("torch._dynamo")  # a program that compiles has imported it
    config = getattr(dynamo, "config", None)
    if config is None or not hasattr(config, "force_compile_during_fx_trace"):
        yield
        return
    # PopTorch compiles a graph for one set of input shapes: TorchDynamo specialises on every
    # shape and number there, as the trace does (its guards on symbolic values fail inside it).
    with config.patch(force_compile_during_fx_trace=True, automatic_dynamic_shapes=False,
                      specialize_int=True, specialize_float=True):
        yield


def without_ipu_devices(args: Sequence[Any], kwargs: Dict[str, Any]
                        ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A call's arguments without those that name the IPU (see the module docstring)."""
    return (tuple(a for a in args if not names_ipu(a)),
            {k: v for k, v in kwargs.items() if not names_ipu(v)})


def call_as_captured(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """What the trace's function rules do with ``torch.device(...)`` (made as asked: an IPU
    device stays one, and each use of it is mapped to the host's device) and, while
    TorchDynamo captures (:func:`compiling`), with any call: the program's own call, without
    its IPU devices; the compiled artifact meets the rules as it runs."""
    if func is not torch.device:
        args, kwargs = without_ipu_devices(args, kwargs)
    return func(*args, **kwargs)
