"""Config loading and validation: shipped configs load, broken ones name the bad key."""
from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from helpers import ROOT

from ipu_unit_scaling.training.config_files import CONFIGS_DIR, ConfigError
from ipu_unit_scaling.training.run_config import (
    Config,
    config_from_dict,
    load_config,
    resolve_layers_per_ipu,
    scheduled_learning_rate,
    validate,
)

SHIPPED = sorted(CONFIGS_DIR.glob("*.yaml"))


def test_configs_dir_is_the_repository_one():
    assert CONFIGS_DIR == ROOT / "configs"
    names = {p.stem for p in SHIPPED}
    assert {"default", "fp32", "plain", "tiny", "ipu-2", "ipu-4"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_validates(path):
    config = load_config(path)
    validate(config)
    assert config_from_dict(config.to_dict()) == config  # round trip through plain data


def test_default_yaml_spells_out_the_dataclass_defaults():
    with open(CONFIGS_DIR / "default.yaml", encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    assert raw == Config().to_dict()  # every key, every default
    assert load_config(None) == Config()


def test_twins_differ_from_default_only_where_they_say():
    default, fp32, plain = (load_config(name).to_dict() for name in ("default", "fp32", "plain"))
    assert fp32["precision"]["dtype"] == "fp32"
    fp32["precision"]["dtype"] = default["precision"]["dtype"]
    assert fp32 == default
    assert plain["model"]["unit_scaled"] is False
    assert plain["training"]["learning_rate"] < default["training"]["learning_rate"]


def test_ipu_4_layout():
    config = load_config("ipu-4")
    assert config.total_ipus == 8
    assert resolve_layers_per_ipu(config.ipu.layers_per_ipu, 16, 4) == [1, 5, 5, 5]
    assert config.micro_batch_size * 16 * 2 == config.training.batch_size


def test_overrides_are_parsed_as_yaml_and_validated():
    config = load_config("tiny", ["training.steps=7", "ipu.layers_per_ipu=[2, 0]",
                                  "training.learning_rate=1e-3", "data.path=corpus.txt"])
    assert config.training.steps == 7
    assert config.ipu.layers_per_ipu == [2, 0]
    assert config.training.learning_rate == 1e-3  # YAML reads 1e-3 as a string
    assert config.data.path == "corpus.txt"
    with pytest.raises(ConfigError, match="training.steps"):
        load_config("tiny", ["training.steps=-1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config("tiny", ["training.steps"])


def test_anchors_merge_keys_and_extends(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "model: &model {depth: 6, hidden_size: 96, heads: 3}\n"
        "training: {steps: 10, warmup_steps: 0}\n"
    )
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\n"
        "model:\n  <<: {depth: 2, heads: 2}\n  hidden_size: 64\n"
        "compare: {learning_rates: {fp32: 0.5}}\n"
    )
    config = load_config(tmp_path / "child.yaml")
    assert (config.model.depth, config.model.hidden_size, config.model.heads) == (2, 64, 2)
    assert config.training.steps == 10
    assert config.compare.learning_rates["fp32"] == 0.5
    assert config.compare.learning_rates["unit-fp8"] == Config().compare.learning_rates["unit-fp8"]
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "loop.yaml")


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["training.learning_rat=0.1"])
    message = str(info.value)
    assert "training.learning_rat" in message and "did you mean 'learning_rate'" in message


def test_errors_are_all_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.depth=0", "training.optimizer=adamm", "backend=GPU"])
    paths = [path for path, _ in info.value.errors]
    assert {"model.depth", "training.optimizer", "backend"} <= set(paths)
    assert "did you mean 'adam'" in str(info.value)


# (overrides, key path the error must name, words the message must contain)
BROKEN = [
    (["model.depth=four"], "model.depth", "expected an int"),
    (["model.depth=true"], "model.depth", "expected an int"),
    (["model.unit_scaled=1"], "model.unit_scaled", "expected a bool"),
    (["model.heads=3"], "model.heads", "must divide model.hidden_size"),
    (["model.dropout=1.5"], "model.dropout", "0 <= dropout < 1"),
    (["model.attn_tau=0"], "model.attn_tau", "0 < tau <= 1e+06"),
    (["model.mlp_tau=10000000.0"], "model.mlp_tau", "0 < tau <= 1e+06"),
    (["model.widht=3"], "model.widht", "unknown key"),
    (["modle.depth=3"], "modle", "did you mean 'model'"),
    (["model=3"], "model", "expected a mapping"),
    (["precision.dtype=fp4"], "precision.dtype", "fp32, fp16, fp8"),
    (["precision.fp8.scaling=max"], "precision.fp8.scaling", "amax, static"),
    (["precision.fp8.activation_format=E4M3"], "precision.fp8.activation_format", "F143"),
    (["precision.fp8.rounding=up"], "precision.fp8.rounding", "nearest, stochastic"),
    (["precision.fp8.overflow=wrap"], "precision.fp8.overflow", "saturate, nan"),
    (["precision.fp8.gradient_margin=40"], "precision.fp8.gradient_margin", "0 .. 31"),
    (["precision.fp8.weight_margin=-1"], "precision.fp8.weight_margin", "0 .. 31"),
    (["precision.fp8.activation_margin=1.5"], "precision.fp8.activation_margin",
     "expected an int"),
    (["precision.fp8.margin=1"], "precision.fp8.margin", "unknown key"),
    (["ipu.layers_per_ipu=[1, 1, 0]"], "ipu.layers_per_ipu", "one entry per IPU"),
    (["ipu.layers_per_ipu=[1, 2]"], "ipu.layers_per_ipu", "places 3 layers but model.depth is 2"),
    (["ipu.layers_per_ipu=[2, -1]"], "ipu.layers_per_ipu", "each needs at least one"),
    (["ipu.layers_per_ipu=[3, -2]"], "ipu.layers_per_ipu", "-1 for 'share the rest'"),
    (["ipu.layers_per_ipu=2"], "ipu.layers_per_ipu", "expected a list of ints"),
    (["ipu.ipus_per_replica=3", "ipu.layers_per_ipu=[-1,-1,-1]", "model.depth=3",
      "ipu.gradient_accumulation=8"], "ipu.replication_factor", "not a power of two"),
    (["ipu.replication_factor=3", "training.batch_size=24"], "ipu.replication_factor",
     "auto_round_num_ipus"),
    (["ipu.gradient_accumulation=2", "training.batch_size=4"], "ipu.gradient_accumulation",
     "at least 2 x 2 - 1 = 3"),
    (["ipu.device_iterations=0"], "ipu.device_iterations", "must be >= 1"),
    (["ipu.available_memory_proportion=[0.5, 0.5, 0.5]"], "ipu.available_memory_proportion",
     "one per IPU"),
    (["ipu.available_memory_proportion=1.5"], "ipu.available_memory_proportion", "0 < x <= 1"),
    (["ipu.partials_type=double"], "ipu.partials_type", "float, half"),
    (["ipu.executable_cache_dir=5"], "ipu.executable_cache_dir", "expected a string or null"),
    (["training.batch_size=6"], "training.batch_size", "multiple of ipu.gradient_accumulation"),
    (["training.optimizer=lamb"], "training.optimizer", "sgd, adam, adamw"),
    (["training.schedule=linear"], "training.schedule", "constant, cosine"),
    (["training.learning_rate=0"], "training.learning_rate", "must be > 0"),
    (["training.learning_rate=fast"], "training.learning_rate", "expected a finite float"),
    (["training.warmup_steps=-1"], "training.warmup_steps", ">= 0"),
    (["training.seed=-1"], "training.seed", "0 .. 2**63 - 1"),
    (["training.seed=18446744073709551616"], "training.seed", "-2**63 .. 2**63 - 1"),
    (["ipu.device_iterations=2"], "training.steps", "multiple of ipu.device_iterations"),
    (["data.path=''"], "data.path", "expected a file path"),
    (["training.grad_clip=-1"], "training.grad_clip", "> 0 or null"),
    (["data.val_fraction=1"], "data.val_fraction", "0 < x < 1"),
    (["compare.regimes=[fp32, fp64]"], "compare.regimes[1]", "unit-fp8-amax"),
    (["compare.regimes=[fp32, fp32]"], "compare.regimes", "at most once"),
    (["compare.learning_rates={fp8-amx: 0.1}"], "compare.learning_rates.fp8-amx",
     "did you mean 'fp8-amax'"),
    # (a well-formed name the registry does not hold is refused when the run chooses it)
    (["backend=GPU"], "backend", "lowercase letters, digits and underscores"),
    (["backend=" + "x" * 41], "backend", "at most 40 characters"),
]


@pytest.mark.parametrize("overrides,key,words", BROKEN, ids=[b[1] for b in BROKEN])
def test_broken_config_names_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides)
    paths = [path for path, _ in info.value.errors]
    assert key in paths, str(info.value)
    assert words in str(info.value)
    name, _, bad = overrides[0].partition("=")
    if name == key and "unknown key" not in words:  # the bad value is shown too
        assert bad.strip("[]{}").split(",")[0].lower() in str(info.value).lower()


def test_auto_round_num_ipus_allows_odd_ipu_counts():
    overrides = ["ipu.replication_factor=3", "training.batch_size=24"]
    assert load_config("tiny", overrides + ["ipu.auto_round_num_ipus=true"]).total_ipus == 6


def test_validate_checks_objects_built_in_code():
    config = Config()
    config = replace(config, ipu=replace(config.ipu, layers_per_ipu=[1, 1]))
    with pytest.raises(ConfigError, match="ipu.layers_per_ipu"):
        validate(config)
    config = Config()
    config = replace(config, training=replace(config.training, steps="many"))
    with pytest.raises(ConfigError, match="training.steps"):
        validate(config)


@pytest.mark.parametrize("counts,depth,expected", [
    ([-1], 4, [4]),
    ([1, -1, -1, -1], 16, [1, 5, 5, 5]),
    ([-1, -1, -1], 7, [2, 2, 3]),  # the remainder goes to the later IPUs
    ([0, -1], 3, [0, 3]),
    ([3, 5], 8, [3, 5]),
])
def test_layers_per_ipu_resolution(counts, depth, expected):
    assert resolve_layers_per_ipu(counts, depth, len(counts)) == expected
    assert sum(expected) == depth


def test_learning_rate_schedule():
    training = load_config(None, ["training.steps=110", "training.warmup_steps=10"]).training
    assert scheduled_learning_rate(training, 0) == pytest.approx(training.learning_rate / 10)
    assert scheduled_learning_rate(training, 9) == pytest.approx(training.learning_rate)
    assert scheduled_learning_rate(training, 60) == pytest.approx(training.learning_rate / 2)
    assert scheduled_learning_rate(training, 110) == pytest.approx(0.0, abs=1e-12)
    training = replace(training, schedule="constant")
    assert scheduled_learning_rate(training, 100) == training.learning_rate


def test_model_and_fp8_sections_are_the_library_config_classes():
    from ipu_unit_scaling.fp8 import FP8Config
    from ipu_unit_scaling.models import GPTConfig
    from ipu_unit_scaling.training.run_config import Config, PrecisionConfig

    assert type(Config().model) is GPTConfig
    config = load_config("tiny", ["precision.fp8.gradient_margin=5", "model.bias=true"])
    assert type(config.precision.fp8) is FP8Config and config.precision.fp8.gradient_margin == 5
    assert type(config.model) is GPTConfig and config.model.bias is True
    assert PrecisionConfig().fp8 == FP8Config()  # same defaults, because the same class
    assert Config().model == GPTConfig()


def test_fp8_rules_are_the_fp8_config_rules():
    """A margin FP8Config refuses is refused by the config too, naming the key, before a run."""
    from ipu_unit_scaling.fp8 import FP8Config

    with pytest.raises(ValueError, match="weight_margin"):
        FP8Config(weight_margin=-2)
    with pytest.raises(ConfigError) as info:
        load_config("tiny", ["precision.fp8.weight_margin=-2", "precision.fp8.scaling=max"])
    assert {path for path, _ in info.value.errors} == {
        "precision.fp8.weight_margin", "precision.fp8.scaling"}


def test_warmup_longer_than_the_run_is_clamped():
    training = load_config("default", ["training.steps=20"]).training
    assert training.warmup_steps == 50  # kept as written; the schedule clamps it
    rates = [scheduled_learning_rate(training, step) for step in range(20)]
    assert rates[-1] == pytest.approx(training.learning_rate)  # warmed up at the last step
    assert all(a < b for a, b in zip(rates, rates[1:]))


def test_exponent_notation_is_a_float_in_mappings_too():
    from ipu_unit_scaling.training.run_config import load_config

    config = load_config(None, ["compare.learning_rates.fp32=1e-3", "training.learning_rate=2e-3"])
    assert config.compare.learning_rates["fp32"] == 1e-3
    assert config.training.learning_rate == 2e-3


# ------------------------------------------------------------------ what a --set value means

REFUSED = object()

# (override, key path, value it sets) or (override, key path, REFUSED, words of the refusal).
SET_TABLE = [
    ("training.steps=10", "training.steps", 10),
    ("training.steps=010", "training.steps", REFUSED, "010 is ambiguous"),
    ("training.steps=-010", "training.steps", REFUSED, "write -10"),
    ("training.steps=0_10", "training.steps", REFUSED, "leading 0 as octal"),
    ("training.steps=00", "training.steps", REFUSED, "write 0 for the number"),
    ("training.steps=!!int 010", "training.steps", REFUSED, "010 is ambiguous"),
    ("training.steps=0o10", "training.steps", REFUSED, "expected an int"),
    ("training.steps=09", "training.steps", REFUSED, "expected an int"),  # text in YAML 1.1
    ("training.steps=0x10", "training.steps", 16),
    ("training.steps=0b10", "training.steps", 2),
    ("training.steps=1:00", "training.steps", REFUSED, "base-60"),
    ("training.steps=1:00:00", "training.steps", REFUSED, "1:00:00 is ambiguous"),
    ("training.learning_rate=1:30.5", "training.learning_rate", REFUSED, "base-60"),
    ("training.steps=1_000", "training.steps", 1000),
    ("training.steps=1e3", "training.steps", REFUSED, "expected an int"),
    ("training.steps='10'", "training.steps", REFUSED, "expected an int"),
    ("training.steps=10.0", "training.steps", REFUSED, "expected an int"),
    ("training.learning_rate=1e3", "training.learning_rate", 1000.0),
    ("training.learning_rate=1e-3", "training.learning_rate", 0.001),
    ("training.learning_rate=010.5", "training.learning_rate", 10.5),  # decimal in any YAML
    ("training.learning_rate=.5", "training.learning_rate", 0.5),
    ("training.learning_rate=inf", "training.learning_rate", REFUSED, "finite float"),
    ("training.learning_rate=.inf", "training.learning_rate", REFUSED, "finite float"),
    ("training.learning_rate=nan", "training.learning_rate", REFUSED, "finite float"),
    ("training.learning_rate=.nan", "training.learning_rate", REFUSED, "finite float"),
    ("training.seed=-0", "training.seed", 0),
    ("training.weight_decay=-0", "training.weight_decay", 0.0),
    ("training.seed=+7", "training.seed", 7),
    ("ipu.stochastic_rounding=true", "ipu.stochastic_rounding", True),
    ("ipu.stochastic_rounding=False", "ipu.stochastic_rounding", False),
    ("ipu.stochastic_rounding=yes", "ipu.stochastic_rounding", REFUSED, "write true"),
    ("ipu.stochastic_rounding=Yes", "ipu.stochastic_rounding", REFUSED, "write true"),
    ("ipu.stochastic_rounding=no", "ipu.stochastic_rounding", REFUSED, "write false"),
    ("ipu.stochastic_rounding=on", "ipu.stochastic_rounding", REFUSED, "write true"),
    ("ipu.stochastic_rounding=OFF", "ipu.stochastic_rounding", REFUSED, "write false"),
    ("ipu.stochastic_rounding=y", "ipu.stochastic_rounding", REFUSED, "expected a bool"),
    ("ipu.stochastic_rounding=1", "ipu.stochastic_rounding", REFUSED, "expected a bool"),
    ("training.grad_clip=null", "training.grad_clip", None),
    ("training.grad_clip=~", "training.grad_clip", None),
    ("training.grad_clip=", "training.grad_clip", REFUSED, "the value is empty"),
    ("training.grad_clip=  ", "training.grad_clip", REFUSED, "the value is empty"),
    ("data.path=corpus.txt", "data.path", "corpus.txt"),
    ("data.path='010'", "data.path", "010"),
    ('data.path="1:00"', "data.path", "1:00"),
    ("data.path='yes'", "data.path", "yes"),
    ("data.path=''", "data.path", REFUSED, "expected a file path"),
    ("data.path=0o10", "data.path", "0o10"),
    ("data.path=yes", "data.path", REFUSED, "yes is ambiguous"),
    ("data.path=010", "data.path", REFUSED, "quote it ('010')"),
    ("ipu.layers_per_ipu=[2, 0]", "ipu.layers_per_ipu", [2, 0]),
    ("ipu.layers_per_ipu=[01, 1]", "ipu.layers_per_ipu", REFUSED, "01 is ambiguous"),
    ("ipu.layers_per_ipu=[1, 1", "ipu.layers_per_ipu", REFUSED, "not valid YAML"),
    ("compare.learning_rates={fp32: 1e-2}", "compare.learning_rates.fp32", 0.01),
    ("compare.learning_rates={fp32: 1:00}", "compare.learning_rates", REFUSED, "base-60"),
    ("compare.regimes=[fp32, on]", "compare.regimes", REFUSED, "on is ambiguous"),
]


def _at(config: Config, path: str):
    node = config.to_dict()
    for part in path.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("row", SET_TABLE, ids=[row[0] for row in SET_TABLE])
def test_a_set_value_means_what_was_typed_or_is_refused_in_one_line(row):
    override, key, expected = row[:3]
    if expected is not REFUSED:
        value = _at(load_config("tiny", [override]), key)
        assert value == expected and type(value) is type(expected), (override, value)
        return
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    ((path, message),) = info.value.errors
    assert key.startswith(path) or path == key, (path, message)
    assert row[3] in message and "\n" not in message, message


def test_the_set_table_reaches_the_command_line_and_bert_settings(tmp_path, capsys):
    from ipu_unit_scaling.apps.cli import main
    from ipu_unit_scaling.apps.mlm import MLMConfig

    assert main(["train", "--config", "tiny", "--set", "training.steps=010",
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "training.steps: 010 is ambiguous" in err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    with pytest.raises(ConfigError, match="1:00 is ambiguous"):
        MLMConfig().with_overrides(["mlm.steps=1:00"])
    assert MLMConfig().with_overrides(["mlm.steps=0x10"]).steps == 16


@pytest.mark.parametrize("text, words", [
    ("training: {steps: 010}", "line 2, column 19: 010 is ambiguous"),
    ("training:\n  steps: 1:00", "line 3, column 10: 1:00 is ambiguous"),
    ("ipu: {stochastic_rounding: on}", "line 2, column 28: on is ambiguous: YAML 1.1 reads it as "
                                       "true"),
])
def test_config_files_refuse_the_same_spellings_with_their_line(tmp_path, text, words):
    path = tmp_path / "c.yaml"
    path.write_text(f"extends: {CONFIGS_DIR / 'tiny.yaml'}\n{text}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"config file {str(path)!r}, {words}" in str(info.value)


def test_a_saved_config_with_text_that_looks_like_numbers_reads_back(tmp_path):
    config = load_config("tiny", ["data.path='010'", "training.checkpoint_dir='yes'"])
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    again = load_config(path)
    assert again.data.path == "010" and again.training.checkpoint_dir == "yes"
