"""The FP8 recipes' training steps against the FP32 step, timed interleaved in one group."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from .measure import Step, time_interleaved
from .variants import OURS, Shape, make_batch, train_steps

# The bound for a training step under the fine-grained recipes.
FP8_RECIPE_TARGET = 1.15
# (row key, recipe name, label, target): the recipes with a bound, then information rows.
RECIPE_ROWS = (
    ("fp8_block_ours", "block", "FP8 step, block recipe (1x128 tiles, 128x128 weight blocks) / "
     "FP32 step: ours", FP8_RECIPE_TARGET),
    ("fp8_mx_ours", "mx", "FP8 step, MX recipe (MXFP8, 32-element E8M0 blocks) / FP32 step: "
     "ours", FP8_RECIPE_TARGET),
    ("fp8_rowwise_ours", "rowwise", "FP8 step, rowwise recipe / FP32 step: ours", None),
    ("fp8_delayed_ours", "delayed", "FP8 step, delayed scaling / FP32 step: ours", None),
)


def _cast_note() -> str:
    from ipu_unit_scaling.fp8 import host_library as _host

    if not _host.fused_cast_available():
        return f"grouped casts in torch ops: host library {_host.fast_path_status()}"
    from ipu_unit_scaling.ops import native_layers

    caller = ("the layers' C++ nodes" if native_layers.module() is not None
              else "the layers' two Python Functions")
    return ("grouped casts by the host library's block kernels, both casts of each GEMM operand "
            f"from one read, called from {caller}")


def recipe_rows(row: Callable[..., Any], shape: Shape, rounds: int, min_run_time: float,
                clock: str, step_ms: Dict[str, float]) -> List[Any]:
    """The rows of :data:`RECIPE_ROWS` as ``row(key, label, value, target, note, spread)``;
    each step's median goes into ``step_ms`` as ``fp8 <recipe>``."""
    batch = make_batch(shape)
    steps: Dict[str, List[Step]] = {"fp32": train_steps(OURS, shape, batch)}
    for _, recipe, _, _ in RECIPE_ROWS:
        steps[recipe] = train_steps(OURS, shape, batch, recipe)
    timings = time_interleaved(steps, rounds, min_run_time, clock=clock)
    rows = []
    for key, recipe, label, target in RECIPE_ROWS:
        step_ms[f"fp8 {recipe}"] = timings.median_ms(recipe)
        rows.append(row(key, label, timings.ratio(recipe, "fp32"), target,
                        _cast_note() if target else "", timings.spread(recipe, "fp32")))
    return rows
