"""ipu-unit-scaling: unit scaling and FP8-AMAX for PyTorch, IPU-first.

``import ipu_unit_scaling as uu`` gives the unit-scaled modules (mirroring ``torch.nn``);
``import ipu_unit_scaling.functional as U`` gives the unit-scaled ops (mirroring
``torch.nn.functional``). The public API of Graphcore Research's unit-scaling library (0.3.5) is
a subset of this one: code written for it runs with only its import changed.

Package map, from the bottom layer up (a module imports only from its own layer or below):

    ops/              U: the scaling primitive, constraints, the unit-scaled ops, their fused
                      eager forms, ipu_tracing(), the switch to their PopTorch forms, and
                      rules(), the switch to unit-scaling 0.3.5's rules
    modules/          uu: the unit-scaled torch.nn mirror and unit-scaling's u-μP blocks
    fp8/              FP8 formats, the AMAX scaling rule, casts, FP8 linear layers, the
                      host build of the codelets and their tile-by-tile emulator
    transforms/       unit_scale(model), simulate_fp8(model) and the other model rewrites,
                      scale tracking
    parametrization/  u-μP: per-weight scales, multipliers and learning rates; the optimizers
    models/           example models: the GPT (unit-scaled, u-μP or plain) and a BERT encoder
    training/         the run config, data, run directories, memory estimate, precision
                      regimes, validation and plots
    analysis/         scale tracking and reports over a model's ops
    backends/         cpu, poptorch (IPUs; the emulator runs it on the PopTorch stand-in),
                      popxl, distributed
    loop/             the one training loop and its tasks (causal LM, masked LM)
    apps/             the ipu-unit-scaling command: train, compare, sweep, evaluate, sample, ...

At the top level sit only public paths: this package (uu), ``functional`` (U), ``ipu``
(``ipu_tracing``, ``check_poptorch``, ``trace_like_poptorch``) and unit-scaling's module paths
(``scale``, ``constraints``, ``formats``, ``parameter``, ``optim``, ``utils``, ``docs``,
``core.functional``), each re-exporting the layer that writes it. Every other public name has one
import path: the module that defines it, or its layer's package.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

# The names below are imported when first used (PEP 562), so that importing the package, or
# running `ipu-unit-scaling --version` and `--help`, does not load torch and every layer.
if TYPE_CHECKING:
    from . import constraints, core, formats, functional, optim, parameter, scale
    from .models.gpt import GPT
    from .modules.depth_blocks import (
        MHSA,
        MLP,
        DepthModuleList,
        DepthSequential,
        TransformerDecoder,
        TransformerLayer,
        TransformerStack,
    )
    from .modules.gpt_blocks import (
        TORCH_OPS,
        UNIT_OPS,
        FeedForward,
        GatedMLP,
        Ops,
        SelfAttention,
        TransformerBlock,
        unit_attention,
    )
    from .modules.layers import (
        GELU,
        AttentionProjection,
        Conv1d,
        CrossEntropyLoss,
        Dropout,
        Embedding,
        LayerNorm,
        Linear,
        LinearReadout,
        ReLU,
        RMSNorm,
        SiLU,
        Softmax,
    )
    from .modules.mup_parameter import MupType, Parameter
    from .ops.op_helpers import transformer_residual_scaling_rule
    from .ops.rule_switch import RULES, active_rules, rules
    from .ops.scaling_primitive import scale_bwd, scale_fwd

_SUBMODULES = ("constraints", "core", "formats", "functional", "optim", "parameter", "scale")
_LAZY = {
    "MHSA": ".modules.depth_blocks",
    "MLP": ".modules.depth_blocks",
    "DepthModuleList": ".modules.depth_blocks",
    "DepthSequential": ".modules.depth_blocks",
    "TransformerDecoder": ".modules.depth_blocks",
    "TransformerLayer": ".modules.depth_blocks",
    "TransformerStack": ".modules.depth_blocks",
    "GPT": ".models.gpt",
    "TORCH_OPS": ".modules.gpt_blocks",
    "UNIT_OPS": ".modules.gpt_blocks",
    "FeedForward": ".modules.gpt_blocks",
    "GatedMLP": ".modules.gpt_blocks",
    "Ops": ".modules.gpt_blocks",
    "SelfAttention": ".modules.gpt_blocks",
    "TransformerBlock": ".modules.gpt_blocks",
    "unit_attention": ".modules.gpt_blocks",
    "GELU": ".modules.layers",
    "AttentionProjection": ".modules.layers",
    "Conv1d": ".modules.layers",
    "CrossEntropyLoss": ".modules.layers",
    "Dropout": ".modules.layers",
    "Embedding": ".modules.layers",
    "LayerNorm": ".modules.layers",
    "Linear": ".modules.layers",
    "LinearReadout": ".modules.layers",
    "ReLU": ".modules.layers",
    "RMSNorm": ".modules.layers",
    "SiLU": ".modules.layers",
    "Softmax": ".modules.layers",
    "MupType": ".modules.mup_parameter",
    "Parameter": ".modules.mup_parameter",
    "transformer_residual_scaling_rule": ".ops.op_helpers",
    "RULES": ".ops.rule_switch",
    "active_rules": ".ops.rule_switch",
    "rules": ".ops.rule_switch",
    "scale_bwd": ".ops.scaling_primitive",
    "scale_fwd": ".ops.scaling_primitive",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # found here from now on
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_SUBMODULES) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    # submodules
    "functional",
    "constraints",
    "core",
    "formats",
    "optim",
    "parameter",
    "scale",
    # scaling primitives and u-μP parameters
    "scale_fwd",
    "scale_bwd",
    "Parameter",
    "MupType",
    "transformer_residual_scaling_rule",
    # which rules the ops follow: this package's or unit-scaling 0.3.5's
    "rules",
    "active_rules",
    "RULES",
    # leaf modules
    "Linear",
    "LinearReadout",
    "Conv1d",
    "AttentionProjection",
    "LayerNorm",
    "Embedding",
    "GELU",
    "ReLU",
    "Softmax",
    "Dropout",
    "CrossEntropyLoss",
    "RMSNorm",
    "SiLU",
    # unit_scaling's u-μP blocks
    "MHSA",
    "MLP",
    "TransformerLayer",
    "TransformerStack",
    "TransformerDecoder",
    "DepthModuleList",
    "DepthSequential",
    # this package's GPT blocks, built from an Ops table
    "SelfAttention",
    "FeedForward",
    "GatedMLP",
    "TransformerBlock",
    "GPT",
    "Ops",
    "UNIT_OPS",
    "TORCH_OPS",
    "unit_attention",
]
