"""rules(): which scaling rules the unit-scaled ops follow: this package's (the default) or those of
Graphcore Research's unit-scaling 0.3.5, for models moved across from it.

A model written for unit-scaling runs here with its import changed, but a few of this package's
rules differ from the library's on purpose (docs/guide/coming-from-unit-scaling.md lists them).
Inside ``rules("unit-scaling")`` every one of those rules follows the library's formula instead,
so such a model computes the library's loss and gradients (to float32 rounding)::

    import ipu_unit_scaling as uu

    with uu.rules("unit-scaling"):
        loss = model.loss(input_ids)   # the library's numbers
        loss.backward()

The ops that change are ``U.matmul`` with a broadcast input, ``U.add`` with a broadcast input
or a single value, ``U.gelu``, ``U.silu``, ``U.silu_glu``, ``U.softmax``, ``U.dropout``,
``U.scaled_dot_product_attention``, ``U.cross_entropy`` (and ``uu.CrossEntropyLoss``),
``U.rms_norm``, ``core.functional.rms`` and ``U.embedding`` with ``max_norm``, and the
modules built on them; the extra query/key gradient scale that ``unit_scale`` gives attention
projections is off. A linear's or conv1d's bias follows the library's rule either way. The
formulas are below, one function per rule. Ops the library does not have (``U.relu``, ...),
this package's own GPT blocks (``uu.GPT`` and its parts, fused for speed), the conversion
``unit_scale`` (its constraints) and the FP8 linears of ``simulate_fp8`` keep this package's
rules.

Scope: like ``torch.no_grad``, the setting belongs to the thread that enters it (and to what
that thread calls); other threads, including ones started inside the block, keep their own
(this package's rules until they enter the switch themselves). Uses nest: the innermost
applies, and leaving a block restores the setting outside it, also when it is left by an
exception. A scale is fixed when the forward pass runs, so a backward pass run later, or on
another thread, gives the gradients of the rules its forward pass ran under. Under
``torch.compile`` the compiled code is guarded on whether any thread is inside the switch, so
compile and call a function on the thread that holds the setting.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, Iterator, List, Sequence, Tuple

__all__ = ["rules", "active_rules", "RULES"]

PACKAGE_RULES = "ipu-unit-scaling"
LIBRARY_RULES = "unit-scaling"
RULES: Tuple[str, ...] = (PACKAGE_RULES, LIBRARY_RULES)


class _Entry:
    """One use of the switch: the rules it names, on the stack of the thread that entered."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _ThreadRules(threading.local):
    def __init__(self) -> None:
        self.stack: List[_Entry] = []


_thread = _ThreadRules()
# How many threads follow the library's rules right now. Read first by every op: a plain global,
# so torch.compile guards on it (it does not guard a thread-local read) and the common case,
# nobody inside the switch, costs one list lookup.
_library_threads = [0]
_count_lock = threading.Lock()


def _name(stack: List[_Entry]) -> str:
    return stack[-1].name if stack else PACKAGE_RULES


def _top() -> str:
    return _name(_thread.stack)


def _check(name: str) -> str:
    if name not in RULES:
        raise ValueError(f"rules({name!r}): the rules are {' or '.join(map(repr, RULES))}")
    return name


@contextlib.contextmanager
def rules(name: str) -> Iterator[None]:
    """Inside this block the unit-scaled ops follow the named rules: ``"unit-scaling"`` (the
    unit-scaling 0.3.5 library's formulas, for its models' numbers) or ``"ipu-unit-scaling"``
    (this package's, the default). Per thread; nested blocks stack; also a decorator."""
    _check(name)
    stack = _thread.stack  # the entering thread's, also if the block is left elsewhere
    entry = _Entry(name)
    _change(stack, lambda: stack.append(entry))
    try:
        yield
    finally:
        # This block's own entry, wherever it now is: a generator suspended inside a block may
        # be closed while later blocks are open.
        _change(stack, lambda: stack.pop(max(i for i, e in enumerate(stack) if e is entry)))


def _change(stack: List[_Entry], edit: Callable[[], object]) -> None:
    with _count_lock:
        before = _name(stack)
        edit()
        _library_threads[0] += (_name(stack) == LIBRARY_RULES) - (before == LIBRARY_RULES)


def active_rules() -> str:
    """The rules the ops follow on this thread now: ``"ipu-unit-scaling"`` or
    ``"unit-scaling"``."""
    return _top()


def library_rules() -> bool:
    """Whether the ops on this thread follow unit-scaling 0.3.5's rules now (for the ops)."""
    return _library_threads[0] > 0 and _top() == LIBRARY_RULES


# ------------------------------------------------------------- the library's formulas
#
# Each is written from unit-scaling 0.3.5's documented rule for the op; the tests check them
# against the same formulas written out independently, in float64.

def _interpolate(alpha: float, lower: float, upper: float) -> float:
    # op_helpers.logarithmic_interpolation's formula; op_helpers imports this module (for
    # `rms`), so this one stays free of it.
    return math.exp(alpha * math.log(upper) + (1 - alpha) * math.log(lower))


_TO_MULT_SQ = 0.25  # gelu's and silu's output-scale model: alpha = sigmoid(log(4 mult**2))


def activation_scales(op: str, mult: float) -> Tuple[float, float]:
    """(output scale, grad-input scale) of ``op`` ("gelu" or "silu") of ``mult * x``, before
    the constraint: logarithmic interpolations between the small-mult limit 2 and the large-mult
    limits sqrt(2 / (1 - 1/pi)) (the output) and sqrt(2) (the gradient)."""
    output_alpha = 1 / (1 + _TO_MULT_SQ / mult**2)
    grad_alpha = output_alpha if op == "gelu" else 1 / (1 + 1 / mult**2)
    output_scale = _interpolate(output_alpha, 2.0, (2 / (1 - 1 / math.pi)) ** 0.5)
    grad_scale = _interpolate(grad_alpha, 2.0, 2**0.5)
    return output_scale, grad_scale


def silu_glu_scale(mult: float) -> float:
    """The one scale of ``silu_glu`` (output, and both input gradients)."""
    return _interpolate(1 / (1 + 1 / mult**2), 2.0, 2**0.5)


def softmax_scales(n: int, mult: float) -> Tuple[float, float]:
    """(output scale, grad-input scale) of a softmax of ``mult * x`` over n: between the flat
    limits (n, n / mult) and the one-hot limits (sqrt(n), sqrt(n / mult))."""
    alpha = 1 / (1 + 4 / mult**2)
    return (_interpolate(alpha, n, n**0.5),
            _interpolate(alpha, n / mult, (n / mult) ** 0.5))


def attention_scale(key_len: int, head_dim: int, mult: float, is_causal: bool,
                    dropout_p: float) -> float:
    """The one scale of attention (its output in the forward pass, query, key and value
    gradients in the backward pass), for logits ``mult * q.k / head_dim``."""
    lower = ((math.log(key_len) if is_causal else 1.0) / key_len) ** 0.5
    spread = _interpolate(1 / (1 + 4 * head_dim / mult**2), lower, 1.0)
    return (1 - dropout_p) ** 0.5 / spread


def cross_entropy_grad_scale(classes: int) -> float:
    """The input gradient's scale: ``classes / sqrt(classes - 1)`` (a uniform softmax)."""
    return classes / (classes - 1) ** 0.5 if classes > 1 else 1.0


def matmul_grad_counts(left: Sequence[int], right: Sequence[int]) -> Tuple[int, int]:
    """The counts whose -1/2 powers are the (left, right) grad scales: the right input's columns
    and the left input's rows (a broadcast batch is not counted)."""
    return right[-1], left[-2]


def add_scales(input_copies: int, other_copies: int, single_value: bool
               ) -> Tuple[float, float, float]:
    """(output, input grad, other grad) scales of ``input + other`` before the constraint: 1
    when either is a single value, else 1/sqrt(2); each gradient ``copies**-0.5`` for the
    copies broadcasting makes of that input."""
    return (1.0 if single_value else 2**-0.5, input_copies**-0.5, other_copies**-0.5)


def dropout_scale(p: float) -> float:
    """sqrt(1 - p), in training and in eval mode alike."""
    return (1 - p) ** 0.5
