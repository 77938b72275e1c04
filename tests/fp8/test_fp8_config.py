"""FP8Config: the recipes as values, and the one-line errors for what a recipe cannot take."""
from __future__ import annotations

import dataclasses

import pytest

from ipu_unit_scaling.fp8 import FP8Config, FP8ConfigError
from ipu_unit_scaling.fp8.fp8_config import GROUPED_SCALINGS, RECIPES, SCALING_MODES


def test_defaults_are_the_ipu_recipe():
    config = FP8Config()
    assert (config.scaling, config.activation_format, config.gradient_format) == (
        "amax", "F143", "F152")
    assert not config.grouped and config.group_size is None


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_name_builds_a_valid_config(name):
    config = FP8Config.from_recipe(name)
    assert config.scaling in SCALING_MODES
    for field, value in RECIPES[name].items():
        assert getattr(config, field) == value


def test_recipe_fields_and_group_sizes():
    assert FP8Config.from_recipe("mx").group_size == 32
    assert FP8Config.from_recipe("nvfp4").group_size == 16
    assert FP8Config.from_recipe("block").group_size == 128
    assert FP8Config(scaling="block", block_size=64).group_size == 64
    assert FP8Config.from_recipe("mx").weight_format == "E4M3FN"
    assert FP8Config.from_recipe("mx_round_up").scale_rounding == "up"
    assert FP8Config.from_recipe("rowwise_with_gw_hp").grad_weight_high_precision
    assert set(GROUPED_SCALINGS) == {"rowwise", "block", "mx", "nvfp4"}
    # "mx" alone keeps the configured element formats (the IPU's, by default).
    assert FP8Config(scaling="mx").activation_format == "F143"


def test_with_recipe_resets_the_other_recipe_fields():
    fp4 = FP8Config.from_recipe("nvfp4", gradient_margin=2)
    back = fp4.with_recipe("amax")
    assert back == dataclasses.replace(FP8Config(), gradient_margin=2)


def test_with_recipe_keeps_the_block_size_and_history_where_the_recipe_reads_them():
    assert FP8Config(scaling="block", block_size=64).with_recipe("block").block_size == 64
    assert FP8Config(scaling="block", block_size=64).with_recipe("mx").block_size is None
    delayed = FP8Config(scaling="delayed", amax_history_length=4, amax_reduction="most_recent")
    assert delayed.with_recipe("delayed") == delayed
    assert delayed.with_recipe("amax") == FP8Config()


def test_the_nvfp4_refusal_is_one_problem_naming_only_what_to_set():
    with pytest.raises(FP8ConfigError) as error:
        FP8Config(scaling="nvfp4", activation_format="E2M1")
    assert error.value.problems == [("scaling", "'nvfp4' takes E2M1 elements: also set "
                                                "weight_format and gradient_format to E2M1 "
                                                "(got F143, F152)")]


@pytest.mark.parametrize("fields,field,words", [
    ({"scaling": "tensorwise"}, "scaling", "allowed: amax, static, delayed"),
    ({"scaling": "mx", "block_size": 64}, "block_size", "fixes it at 32"),
    ({"scaling": "nvfp4", "block_size": 32}, "block_size", "fixes it at 16"),
    ({"scaling": "rowwise", "block_size": 32}, "block_size", "has no blocks"),
    ({"scaling": "block", "block_size": 0}, "block_size", "positive int"),
    ({"scaling": "nvfp4"}, "scaling", "also set activation_format, weight_format and "
                                      "gradient_format to E2M1 (got F143, F143, F152)"),
    ({"activation_format": "E2M1"}, "activation_format", "use scaling 'mx' or 'nvfp4'"),
    ({"scaling": "static", "weight_format": "E3M2"}, "weight_format", "block scale"),
    ({"scaling": "mx", "overflow": "nan"}, "overflow", "saturates"),
    ({"scaling": "amax", "scale_rounding": "up"}, "scale_rounding", "for scaling 'mx'"),
    ({"scaling": "mx", "scale_rounding": "ceil"}, "scale_rounding", "allowed: floor, up"),
    ({"scaling": "delayed", "amax_history_length": 0}, "amax_history_length", "1 .. 1024"),
    ({"scaling": "delayed", "amax_history_length": 2000}, "amax_history_length", "1 .. 1024"),
    ({"scaling": "delayed", "amax_reduction": "mean"}, "amax_reduction", "max, most_recent"),
    ({"scaling": "amax", "amax_history_length": 3}, "amax_history_length",
     "only scaling delayed reads it, not 'amax'"),
    ({"scaling": "block", "amax_reduction": "most_recent"}, "amax_reduction",
     "only scaling delayed reads it"),
    ({"scaling": "amax", "grad_weight_high_precision": True}, "grad_weight_high_precision",
     "grouped recipes"),
    ({"scaling": "mx", "attention": True}, "attention", "per tensor"),
    ({"scaling": "block", "activation_format": "E9M9"}, "activation_format", "unknown"),
])
def test_bad_recipe_settings_are_one_line_naming_the_field(fields, field, words):
    with pytest.raises(FP8ConfigError) as error:
        FP8Config(**fields)
    message = str(error.value)
    assert "\n" not in message
    assert field in [name for name, _ in error.value.problems]
    assert words in message


def test_unknown_recipe_name():
    with pytest.raises(FP8ConfigError, match="allowed: static, amax, delayed"):
        FP8Config.from_recipe("fp8-awesome")


def test_sub_byte_formats_are_fine_with_block_recipes():
    config = FP8Config(scaling="mx", activation_format="E2M3", weight_format="E3M2",
                       gradient_format="E2M1")
    assert config.activation.bits == 6 and config.gradient.bits == 4


def test_simulate_fp8_takes_a_recipe_name_as_its_config():
    import torch

    from ipu_unit_scaling.fp8 import FP8Linear
    from ipu_unit_scaling.transforms import simulate_fp8

    model = simulate_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64)), "mx")
    assert isinstance(model[0], FP8Linear) and model[0].config == FP8Config.from_recipe("mx")
    with pytest.raises(FP8ConfigError, match="recipe: got 'mxfp9'; allowed: static"):
        simulate_fp8(torch.nn.Sequential(torch.nn.Linear(8, 8)), "mxfp9")
    with pytest.raises(TypeError, match="FP8Config or a recipe name, not dict"):
        simulate_fp8(torch.nn.Sequential(torch.nn.Linear(8, 8)), {"scaling": "mx"})
