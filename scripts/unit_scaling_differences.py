"""Measure where this package's ops keep a different rule from unit-scaling 0.3.5's.

    python scripts/unit_scaling_differences.py [--out docs/results/unit_scaling_differences.md]

For each op whose rule differs, the scale of the outputs (and gradients) this package gives is
measured on unit-normal inputs and output gradients, next to what unit-scaling's documented
rule gives for the same op (its scale factors, written out here from its documentation and
applied to the same unscaled op; nothing of the library is imported). Prints a Markdown table;
`--out` also writes it to a file.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

import ipu_unit_scaling.functional as U
from ipu_unit_scaling.scale import scale_bwd, scale_fwd

Row = Tuple[str, str, str]


def log_interpolate(alpha: float, lower: float, upper: float) -> float:
    """unit-scaling's interpolation: lower**(1 - alpha) * upper**alpha."""
    return math.exp((1 - alpha) * math.log(lower) + alpha * math.log(upper))


def rms(t: Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def std(t: Tensor) -> float:
    return float(t.double().std())


def run(fn: Callable[..., Tensor], shapes: Sequence[Sequence[int]], seed: int = 0
        ) -> Tuple[Tensor, List[Tensor]]:
    """(output, input gradients) of `fn` on unit-normal inputs and output gradient."""
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(*s, generator=generator, requires_grad=True) for s in shapes]
    out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=generator))
    return out.detach(), [x.grad for x in inputs]  # type: ignore[misc]


def scaled(fn: Callable[..., Tensor], output_scale: float,
           grad_scales: Sequence[float]) -> Callable[..., Tensor]:
    """`fn` with its output times `output_scale` (forward only) and input i's gradient times
    grad_scales[i] (backward only), as unit-scaling composes its ops."""
    def call(*inputs: Tensor) -> Tensor:
        adjusted = [scale_bwd(x, g) for x, g in zip(inputs, grad_scales)]
        return scale_fwd(fn(*adjusted), output_scale)
    return call


def softmax_rows(n: int) -> List[Row]:
    rows = []
    for mult in (1.0, 0.25):
        alpha = 1 / (1 + 4 / mult**2)
        theirs = scaled(lambda x, m=mult: F.softmax(x * m, dim=-1),
                        log_interpolate(alpha, n, n**0.5), [1.0])
        ours_out, _ = run(lambda x, m=mult: U.softmax(x, -1, mult=m, constraint=None), [(8, n)])
        theirs_out, _ = run(theirs, [(8, n)])
        rows.append((f"softmax, n={n}, mult={mult:g}: output std / rms",
                     f"{std(ours_out):.2f} / {rms(ours_out):.2f}",
                     f"{std(theirs_out):.2f} / {rms(theirs_out):.2f}"))
    return rows


def attention_rows() -> List[Row]:
    rows = []
    cases = [(4, 4, 256, False, 1.0), (4, 4, 256, False, 8.0), (4, 4, 256, True, 1.0),
             (4, 4, 256, True, 8.0), (1, 2, 2048, True, 8.0)]
    head_dim = 64
    for batch, heads, seq, is_causal, mult in cases:  # mult 8 = sqrt(head_dim): logit std 1
        shape = [(batch, heads, seq, head_dim)] * 3
        def ours(q: Tensor, k: Tensor, v: Tensor, m: float = mult,
                 c: bool = is_causal) -> Tensor:
            return U.scaled_dot_product_attention(q, k, v, is_causal=c, mult=m)

        lower = ((math.log(seq) if is_causal else 1.0) / seq) ** 0.5
        alpha = 1 / (1 + 4 * head_dim / mult**2)
        factor = 1 / log_interpolate(alpha, lower, 1.0)

        def theirs(q: Tensor, k: Tensor, v: Tensor, m: float = mult, c: bool = is_causal,
                   f: float = factor, seq: int = seq) -> Tensor:
            q, k, v = (scale_bwd(t, f) for t in (q, k, v))
            scores = q @ k.transpose(-2, -1) * (m / head_dim)
            if c:
                hidden = torch.ones(seq, seq, dtype=torch.bool).triu(1)
                scores = scores.masked_fill(hidden, -math.inf)
            return scale_fwd(scores.softmax(-1) @ v, f)

        ours_out, ours_grads = run(ours, shape)
        theirs_out, theirs_grads = run(theirs, shape)
        name = f"attention, {'causal' if is_causal else 'full'}, {seq} keys, mult={mult:g}"
        rows.append((f"{name}: output std, value grad std",
                     f"{std(ours_out):.2f}, {std(ours_grads[2]):.2f}",
                     f"{std(theirs_out):.2f}, {std(theirs_grads[2]):.2f}"))
    return rows


def matmul_rows() -> List[Row]:
    left_shape, right_shape = (16, 64, 128), (128, 32)  # the right input broadcast over 16
    ours_out, (_, ours_right) = run(lambda a, b: U.matmul(a, b, constraint=None),
                                    [left_shape, right_shape])
    theirs = scaled(torch.matmul, 128**-0.5, [32**-0.5, 64**-0.5])
    theirs_out, (_, theirs_right) = run(theirs, [left_shape, right_shape])
    return [("matmul, right input broadcast over 16: right grad std",
             f"{std(ours_right):.2f}", f"{std(theirs_right):.2f}")]


def dropout_rows() -> List[Row]:
    x = torch.randn(2**16, generator=torch.Generator().manual_seed(0))
    ours = U.dropout(x, 0.1, training=False)
    theirs = F.dropout(x, 0.1, training=False) * 0.9**0.5
    return [("dropout p=0.1 in eval mode: output std", f"{std(ours):.3f}", f"{std(theirs):.3f}")]


def activation_rows() -> List[Row]:
    rows = []
    for mult in (0.25, 1.0, 4.0):
        alpha = 1 / (1 + 0.25 / mult**2)
        gelu_theirs = scaled(lambda x, m=mult: F.gelu(x * m) / m,
                             log_interpolate(alpha, 2.0, (2 / (1 - 1 / math.pi)) ** 0.5),
                             [log_interpolate(alpha, 2.0, 2**0.5)])
        silu_theirs = scaled(lambda x, m=mult: x * torch.sigmoid(x * m),
                             log_interpolate(alpha, 2.0, (2 / (1 - 1 / math.pi)) ** 0.5),
                             [log_interpolate(1 / (1 + 1 / mult**2), 2.0, 2**0.5)])
        for name, ours_fn, theirs_fn in (
            ("gelu", lambda x, m=mult: U.gelu(x, mult=m, constraint=None), gelu_theirs),
            ("silu", lambda x, m=mult: U.silu(x, mult=m, constraint=None), silu_theirs),
        ):
            ours_out, (ours_grad,) = run(ours_fn, [(2**18,)])
            theirs_out, (theirs_grad,) = run(theirs_fn, [(2**18,)])
            rows.append((f"{name}, mult={mult:g}, unconstrained: output std, input grad std",
                         f"{std(ours_out):.3f}, {std(ours_grad):.3f}",
                         f"{std(theirs_out):.3f}, {std(theirs_grad):.3f}"))
    return rows


def table(rows: Sequence[Row]) -> str:
    lines = ["| op: statistic (unit-normal inputs and output gradient) | ipu_unit_scaling | "
             "unit-scaling 0.3.5's rule |", "|---|---|---|"]
    lines += [f"| {name} | {ours} | {theirs} |" for name, ours, theirs in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = (softmax_rows(4096) + attention_rows() + matmul_rows() + dropout_rows()
            + activation_rows())
    text = table(rows)
    print(text)
    if args.out:
        command = "python scripts/unit_scaling_differences.py --out " + str(args.out)
        args.out.write_text(f"Measured with `{command}` (torch {torch.__version__}).\n\n"
                            f"{text}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
