"""What the PopTorch form of unit scaling costs: `python -m benchmarks.traced_forms`.

Under `ipu_tracing()` a scale with different forward and backward multipliers is
`x.detach() * f + (x - x.detach()) * b` instead of a custom autograd Function, so that PopART's
autodiff sees the backward scale. This prints, on the CPU:

- the graph PopTorch would get for the example GPT: ops in total, and elementwise ops that the
  traced scales add, against the same model traced with its scales dropped (what the IPU got
  before, with wrong gradients);
- a forward + backward of one scale on a 1M-element tensor, eager Function against the traced
  form, and a GPT training step run from the traced graph against eager PyTorch.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

import torch

from ipu_unit_scaling import GPT
from ipu_unit_scaling.ipu import ipu_tracing, trace_like_poptorch
from ipu_unit_scaling.scale import scale

from .measure import time_interleaved


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


def _graph_sizes(depth: int, width: int, seq_len: int) -> List[str]:
    # The package exports the function `scale`, which hides the module of the same name.
    scale_module = sys.modules["ipu_unit_scaling.scale"]
    model = GPT(vocab_size=256, hidden_size=width, depth=depth, heads=4,
                               seq_len=seq_len)
    ids = torch.randint(0, 256, (2, seq_len))
    traced_ops = trace_like_poptorch(model, ids, ids).ops()
    original = scale_module.is_ipu_tracing
    scale_module.is_ipu_tracing = lambda: False  # type: ignore[assignment]
    try:
        dropped_ops = trace_like_poptorch(model, ids, ids).ops()
    finally:
        scale_module.is_ipu_tracing = original  # type: ignore[assignment]
    return [
        f"GPT depth {depth} graph, traced scales: {len(traced_ops)} ops "
        f"({traced_ops.count('aten::detach')} detach)",
        f"GPT depth {depth} graph, scales dropped (wrong gradients): {len(dropped_ops)} ops",
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
    for line in _graph_sizes(depth, width, seq_len):
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
