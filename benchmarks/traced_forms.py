"""What the PopTorch form of unit scaling costs: `python -m benchmarks.traced_forms`.

Under `ipu_tracing()` a scale with different forward and backward multipliers is one
`ScaledIdentity` op (forward `x * f`, gradient `b * dy`: a PopART custom op on the IPU, a
`torch.library` op elsewhere) instead of a custom autograd Function, so that PopART's autodiff
sees the backward scale. This prints, on the CPU:

- the graph PopTorch would get for the example GPT: ops in total with the one-op scales, with
  the composite form `x.detach() * f + (x - x.detach()) * b` (what an IPU gets without the
  custom-op library), with the scales dropped (each scale one multiply, as PopTorch made of the
  eager form, with wrong gradients) and for the plain torch GPT;
- a forward + backward of one scale on a 1M-element tensor, eager Function against the traced
  form, and a GPT training step run from the traced graph against eager PyTorch.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch

from ipu_unit_scaling import GPT
from ipu_unit_scaling.ipu import ipu_tracing, trace_like_poptorch
from ipu_unit_scaling.ops.scaled_identity import composite_scales
from ipu_unit_scaling.scale import scale

from .measure import time_interleaved
from .variants import OURS, TORCH, Shape, build_model, make_batch


@dataclass(frozen=True)
class TracedOpCounts:
    """Ops in the graph PopTorch gets for the GPT (as `trace_like_poptorch` records it)."""

    ours: int  # unit-scaled, each scale one ScaledIdentity op
    composite: int  # unit-scaled, each scale in the six-op composite form
    scales_dropped: int  # unit-scaled, each scale one multiply (its backward scale lost)
    plain: int  # the plain torch GPT
    scaled_identities: int  # ScaledIdentity ops in `ours`

    @property
    def ratio(self) -> float:
        """Ours against the same GPT with plain multiplies: what the one-op scales cost."""
        return self.ours / self.scales_dropped


@contextlib.contextmanager
def _scales_dropped() -> Iterator[None]:
    """Scales keep their eager form (a custom autograd Function) while tracing: what PopTorch
    made of an eager unit-scaled model."""
    scale_module = sys.modules["ipu_unit_scaling.ops.scaling_primitive"]
    original = scale_module.is_ipu_tracing
    scale_module.is_ipu_tracing = lambda: False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        scale_module.is_ipu_tracing = original  # type: ignore[attr-defined]


def traced_op_counts(shape: Shape) -> TracedOpCounts:
    """Trace the unit-scaled GPT of `shape` three ways and the plain one once (fake tensors:
    nothing is computed)."""
    batch = make_batch(shape)
    inputs = (batch["input_ids"], batch["labels"])
    ours = build_model(OURS, shape)
    traced = trace_like_poptorch(ours, *inputs).ops()
    with composite_scales():
        composite = trace_like_poptorch(ours, *inputs).ops()
    with _scales_dropped():
        dropped = trace_like_poptorch(ours, *inputs).ops()
    plain = trace_like_poptorch(build_model(TORCH, shape), *inputs).ops()
    return TracedOpCounts(len(traced), len(composite), len(dropped), len(plain),
                          traced.count("ipu_unit_scaling::scaled_identity"))


def _scale_steps(numel: int) -> Dict[str, Callable[[], object]]:
    x = torch.randn(numel, requires_grad=True)
    grad = torch.randn(numel)

    def eager() -> object:
        return torch.autograd.grad(scale(x, 0.5, 2.0), x, grad)

    def traced() -> object:
        with ipu_tracing():
            y = scale(x, 0.5, 2.0)
        return torch.autograd.grad(y, x, grad)

    return {"scale, eager Function": eager, "scale, traced form": traced}


def _gpt_steps(depth: int, width: int, seq_len: int,
               batch: int) -> Dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    model = GPT(vocab_size=256, hidden_size=width, depth=depth, heads=4,
                               seq_len=seq_len)
    ids = torch.randint(0, 256, (batch, seq_len))
    trace = trace_like_poptorch(model, ids, ids)
    parameters = list(model.parameters())

    def eager() -> object:
        return torch.autograd.grad(model(ids, ids), parameters)

    def traced() -> object:
        return torch.autograd.grad(trace(ids, ids), parameters)

    return {"GPT step, eager": eager, "GPT step, traced graph": traced}


def _graph_sizes(depth: int, width: int, seq_len: int, batch: int) -> List[str]:
    counts = traced_op_counts(Shape(depth=depth, hidden_size=width, seq_len=seq_len,
                                    batch_size=batch))
    where = f"GPT depth {depth} width {width} graph"
    return [
        f"{where}, scales as ScaledIdentity ops: {counts.ours} ops "
        f"({counts.scaled_identities} ScaledIdentity)",
        f"{where}, scales in the composite form: {counts.composite} ops",
        f"{where}, scales dropped (wrong gradients): {counts.scales_dropped} ops",
        f"{where}, plain torch GPT: {counts.plain} ops",
        f"ScaledIdentity / scales dropped: {counts.ratio:.2f}x; composite / scales dropped: "
        f"{counts.composite / counts.scales_dropped:.2f}x",
    ]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.traced_forms",
                                     description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the harness")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    depth, width, seq_len, batch = (1, 16, 8, 2) if args.quick else (4, 128, 64, 8)
    numel = 1 << 10 if args.quick else 1 << 20
    rounds = 1 if args.quick else args.rounds
    for line in _graph_sizes(depth, width, seq_len, batch):
        print(line)
    for steps in (_scale_steps(numel), _gpt_steps(depth, width, seq_len, batch)):
        timings = time_interleaved(steps, rounds=rounds, min_run_time=0.05 if args.quick else 0.3,
                                   clock="cpu")
        eager, traced = list(steps)
        print(f"{eager}: {timings.median_ms(eager):.3f} ms; {traced}: "
              f"{timings.median_ms(traced):.3f} ms; ratio {timings.ratio(traced, eager):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
