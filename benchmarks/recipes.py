"""The FP8 recipes' training steps against the FP32 step, timed interleaved in one group."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from .measure import Step, time_interleaved
from .variants import OURS, Shape, make_batch, train_steps

# The bounds of a training step under each recipe: every cast by a host kernel called from
# C++ nodes (the layers' and the readout's), so that the casts' memory traffic is most of
# what a recipe adds; the grouped recipes cast each GEMM operand both ways (12 bytes an
# element), rowwise from two reads of it.
FP8_TILE_TARGET = 1.12
FP8_ROWWISE_TARGET = 1.15
FP8_DELAYED_TARGET = 1.10
# (row key, recipe name, label, target)
RECIPE_ROWS = (
    ("fp8_block_ours", "block", "FP8 step, block recipe (1x128 tiles, 128x128 weight blocks) / "
     "FP32 step: ours", FP8_TILE_TARGET),
    ("fp8_mx_ours", "mx", "FP8 step, MX recipe (MXFP8, 32-element E8M0 blocks) / FP32 step: "
     "ours", FP8_TILE_TARGET),
    ("fp8_rowwise_ours", "rowwise", "FP8 step, rowwise recipe / FP32 step: ours",
     FP8_ROWWISE_TARGET),
    ("fp8_delayed_ours", "delayed", "FP8 step, delayed scaling / FP32 step: ours",
     FP8_DELAYED_TARGET),
)


def _cast_note(recipe: str) -> str:
    from ipu_unit_scaling.fp8 import host_library as _host

    if not _host.fused_cast_available():
        return f"casts in torch ops: host library {_host.fast_path_status()}"
    from ipu_unit_scaling.ops import native_layers

    caller = ("the layers' and the readout's C++ nodes" if native_layers.module() is not None
              else "Python Functions")
    if recipe == "delayed":
        return (f"per-tensor casts by the host library, scales from each role's amax history, "
                f"called from {caller}")
    how = "from two reads" if recipe == "rowwise" else "from one read"
    return ("grouped casts by the host library's block kernels, both casts of each GEMM operand "
            f"{how}, called from {caller}")


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
                        _cast_note(recipe), timings.spread(recipe, "fp32")))
    return rows
