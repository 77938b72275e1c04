"""Names and limits of the run config that the command line shows before anything heavy is
imported (its ``--help`` lists the regimes, model kinds and precisions): :mod:`.run_config`
holds the schema and checks a config against them."""
from __future__ import annotations

REGIMES = (
    "fp32",
    "fp16",
    "fp8-naive",
    "fp8-amax",
    "unit-fp32",
    "unit-fp16",
    "unit-fp8",
    "unit-fp8-amax",
    "umup-fp32",
    "umup-fp16",
    "umup-fp8",
    "umup-fp8-amax",
)
MAX_SEED = 2**63 - 1
# The FP8 recipes of ``compare --recipes`` (``fp8.fp8_config.RECIPES``, kept equal by a test).
FP8_RECIPE_NAMES = ("static", "amax", "delayed", "rowwise", "rowwise_with_gw_hp", "block", "mx",
                    "mx_round_up", "mxfp4", "nvfp4")
# The model kinds a regime trains (``training.precision.with_model_kind``).
MODEL_KINDS = ("plain", "unit", "u-mup")
# The post-training precisions of ``evaluate`` and ``sample`` (``training.inference.PRECISIONS``
# gives each its dtype and FP8 scaling).
PRECISION_NAMES = ("fp32", "fp16", "fp8-static", "fp8-amax")
