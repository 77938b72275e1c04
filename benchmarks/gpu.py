"""GPU rows: FP8 GEMMs and the FP8-simulated step where a CUDA device exists.

- `torch._scaled_mm` with E4M3 operands against a bf16 GEMM of the same shape;
- the unit-scaled GPT in FP8 with static scaling against AMAX scaling (per-tensor amaxes read
  on the host at every cast).

Without CUDA (or without `torch._scaled_mm`, or on a GPU without FP8) the rows are skipped
with the reason, never guessed.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

GEMM_SIZE = 4096
GEMM_LABEL = (f"GPU: FP8 GEMM (torch._scaled_mm, E4M3) / bf16 GEMM, {GEMM_SIZE}^3 "
              "(lower is faster)")
STEP_LABEL = "GPU: unit-scaled FP8 step, static / AMAX scaling"


def _why_no_gpu() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm or float8 dtypes"
    return None


def _time(functions: dict, rounds: int) -> Any:
    from .measure import time_interleaved

    def synced(function: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            out = function()
            torch.cuda.synchronize()
            return out

        return run

    return time_interleaved({name: synced(f) for name, f in functions.items()}, rounds,
                            min_run_time=0.2, clock="wall")


def _gemm_ratio(rounds: int) -> Any:
    from ipu_unit_scaling.fp8 import E4M3FN, cast_to_fp8
    from ipu_unit_scaling.fp8.linear import fp8_tensor_matmul, fp8_tensor_transpose

    n = GEMM_SIZE
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    a8, b8 = cast_to_fp8(a, E4M3FN), fp8_tensor_transpose(cast_to_fp8(b, E4M3FN))
    a16, b16 = a.to(torch.bfloat16), b.t().to(torch.bfloat16)
    return _time({"fp8": lambda: fp8_tensor_matmul(a8, b8, torch.bfloat16, True),
                  "bf16": lambda: a16 @ b16}, rounds)


def _step_ratio(rounds: int) -> Any:
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.transforms import simulate_fp8

    from .variants import OURS, Shape, build_model, make_batch, make_train_step

    shape = Shape(vocab_size=1024, seq_len=256, depth=4, hidden_size=1024, heads=8,
                  batch_size=16)
    batch = {k: v.cuda() for k, v in make_batch(shape).items()}
    steps = {}
    for scaling in ("static", "amax"):
        config = FP8Config(activation_format="E4M3FN", weight_format="E4M3FN",
                           gradient_format="E5M2", scaling=scaling)
        model = simulate_fp8(build_model(OURS, shape).cuda(), config)
        steps[scaling] = make_train_step(model, batch)
    return _time(steps, rounds)


def gpu_rows(row: Callable[..., Any], rounds: int) -> List[Any]:
    """The GPU rows as `row(key, label, value, target, note, spread)`, skipped without CUDA."""
    why = _why_no_gpu()
    if why is not None:
        return [row("gpu_scaled_mm", GEMM_LABEL, None, note=why),
                row("gpu_fp8_static_vs_amax", STEP_LABEL, None, note=why)]
    rows = []
    name = torch.cuda.get_device_name()
    for key, label, measure, (numerator, denominator) in (
            ("gpu_scaled_mm", GEMM_LABEL, _gemm_ratio, ("fp8", "bf16")),
            ("gpu_fp8_static_vs_amax", STEP_LABEL, _step_ratio, ("static", "amax"))):
        try:
            timings = measure(rounds)
        except (RuntimeError, TypeError, ValueError) as error:  # e.g. no FP8 on this GPU
            rows.append(row(key, label, None, note=f"failed on {name}: {error}"))
            continue
        rows.append(row(key, label, timings.ratio(numerator, denominator), None, name,
                        timings.spread(numerator, denominator)))
    return rows
