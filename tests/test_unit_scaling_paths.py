"""Every public module path of unit-scaling 0.3.5 imports here with its prefix swapped
(``unit_scaling.X`` -> ``ipu_unit_scaling.X``), and has each of the library's public names.

The library's modules and names are recorded below as data, read from its wheel
(``unit_scaling-0.3.5-py3-none-any.whl``): a module's ``__all__`` where it has one, else the
names its source binds at the top level (``unit_scaling.docs``, ``unit_scaling.parameter``), and
the public type aliases and maps its modules bind outside ``__all__`` (``Shape``,
``ResidualScalingFn``, ``torch_map``, ``Backend``, ``ScaleDict``). Private modules
(``_modules``, ``_internal_utils``, ``_version``) and the wheel's own ``tests`` package are not
public paths. A path here is an alias: each name is the project's one definition.
"""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest
import torch

LIBRARY_PUBLIC_NAMES = {
    "": ["Conv1d", "CrossEntropyLoss", "DepthModuleList", "DepthSequential", "Dropout",
         "Embedding", "GELU", "LayerNorm", "Linear", "LinearReadout", "MHSA", "MLP", "MupType",
         "Parameter", "RMSNorm", "SiLU", "Softmax", "TransformerDecoder", "TransformerLayer",
         "__version__", "core", "functional", "optim", "parameter",
         "transformer_residual_scaling_rule"],
    "analysis": ["example_batch", "graph_to_dataframe", "plot", "visualiser"],
    "constraints": ["amean", "apply_constraint", "gmean", "hmean", "to_grad_input_scale",
                    "to_left_grad_scale", "to_output_scale", "to_right_grad_scale"],
    "core": ["functional"],
    "core.functional": ["ResidualScalingFn", "logarithmic_interpolation", "rms",
                        "scale_elementwise", "transformer_residual_scaling_rule"],
    "docs": ["T", "binary_constraint_docstring", "docstring_from", "format_docstring",
             "inherit_docstring", "mult_docstring", "ternary_constraint_docstring",
             "variadic_constraint_docstring"],
    "formats": ["FPFormat", "Shape", "format_to_tuple", "tuple_to_format"],
    "functional": ["add", "conv1d", "cross_entropy", "dropout", "embedding", "gelu",
                   "layer_norm", "linear", "linear_readout", "matmul", "mse_loss",
                   "residual_add", "residual_apply", "residual_split", "rms_norm",
                   "scaled_dot_product_attention", "silu", "silu_glu", "softmax", "torch_map"],
    "optim": ["Adam", "AdamW", "SGD", "lr_scale_for_depth", "lr_scale_func_adam",
              "lr_scale_func_sgd", "scaled_parameters"],
    "parameter": ["MupType", "Parameter", "ParameterData", "has_parameter_data"],
    "scale": ["scale_bwd", "scale_fwd"],
    "transforms": ["Metrics", "compile", "prune_non_float_tensors", "prune_same_scale_tensors",
                   "prune_selected_nodes", "simulate_format", "simulate_fp8", "track_scales",
                   "unit_scale"],
    "transforms.utils": ["Backend", "M", "T", "apply_transform", "patch_to_expand_modules",
                         "replace_node_with_function", "torch_nn_modules_to_user_modules"],
    "utils": ["ScaleDict", "ScalePair", "ScaleTracker", "ScaleTrackingInterpreter",
              "analyse_module"],
}


def _path(module: str) -> str:
    return "ipu_unit_scaling" + (f".{module}" if module else "")


@pytest.mark.parametrize("module", sorted(LIBRARY_PUBLIC_NAMES), ids=lambda m: m or "root")
def test_each_library_path_imports_here_with_its_public_names(module):
    imported = importlib.import_module(_path(module))
    missing = [name for name in LIBRARY_PUBLIC_NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{_path(module)} lacks {missing}"


@pytest.mark.parametrize("module", sorted(LIBRARY_PUBLIC_NAMES), ids=lambda m: m or "root")
def test_from_imports_of_each_path_work_in_a_fresh_interpreter(module):
    """``from unit_scaling.X import a, b`` with the prefix swapped, first thing in a program."""
    names = [n for n in LIBRARY_PUBLIC_NAMES[module] if n != "__version__"]
    code = f"from {_path(module)} import {', '.join(names)}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_alias_path_serves_the_projects_one_definition():
    """A name served by two of the library's paths is one object (one definition)."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling import core, docs, formats, functional, parameter, transforms, utils
    from ipu_unit_scaling.transforms import utils as transform_utils

    assert parameter.Parameter is uu.Parameter and parameter.MupType is uu.MupType
    assert core.functional.transformer_residual_scaling_rule is (
        uu.transformer_residual_scaling_rule)
    assert transform_utils.apply_transform is transforms.compose.apply_transform
    assert transform_utils.T is docs.T
    assert functional.torch_map[torch.nn.functional.gelu] is functional.gelu
    assert inspect.getmodule(utils.ScaleTracker).__name__.endswith("module_analysis")
    assert inspect.getmodule(formats.FPFormat).__name__.endswith("generic_formats")
