"""Config values that parse but cannot run are refused in one line, before a run directory is
made: numbers beyond float32 or 64-bit integers, learning rates that overflow the optimizer
step, keys written twice in one YAML mapping, and bad ``--model bert`` settings."""
from __future__ import annotations

import pytest

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.training.config_files import ConfigError
from ipu_unit_scaling.training.run_config import load_config

HUGE = "9" * 5000  # more digits than Python reads as an int by default (4300)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ipu-unit-scaling: error: "), err
    assert "internal error" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("override, words", [
    ("training.learning_rate=1e39", "beyond float32's range"),
    ("training.learning_rate=1e300", "beyond float32's range"),
    # float32 holds 3.4e38, but Adam's first step divides the rate by 0.1: refused by range.
    ("training.learning_rate=1e31", "2**-100 <= x <= 2**100"),
    ("training.learning_rate=3.4e38", "2**-100 <= x <= 2**100"),
    ("training.learning_rate=1e-300", "2**-100 <= x <= 2**100"),  # 0 in float32
    ("training.weight_decay=1e30", "0 <= x <= 2**20"),
    ("training.grad_clip=1e39", "beyond float32's range"),
    ("compare.learning_rates={fp32: 1e39}", "compare.learning_rates.fp32: got 1e+39"),
    ("compare.learning_rates={fp16: 3e38}", "compare.learning_rates.fp16: got 3e+38"),
    (f"training.steps={HUGE}", "(5000 digits) is too large: integers in a config are "
                               "-2**63 .. 2**63 - 1"),
    ("training.steps=9223372036854775808", "integers in a config are -2**63 .. 2**63 - 1"),
    ("training.steps=0x" + "f" * 100, "is too large"),
    # A non-UTF-8 byte of the command line (os.fsdecode's surrogate escape).
    ("data.path=x\udcffy.txt", "data.path: the value is not UTF-8 text (byte 0xff)"),
])
def test_numbers_a_run_cannot_hold_are_refused_in_one_line(override, words):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    ((path, message),) = info.value.errors
    assert words in f"{path}: {message}" and "\n" not in message, message


@pytest.mark.parametrize("arguments", [
    ["train", "--set", "training.learning_rate=1e39"],
    ["train", "--set", "training.learning_rate=3.4e38"],
    ["train", "--set", f"training.steps={HUGE}"],
    ["sweep", "--models", "unit", "--widths", "32", "--log2-lr", "unit=1000:1001"],
    ["sweep", "--models", "unit", "--widths", "32", "--log2-lr", "unit=-1000:0"],
    ["sweep", "--models", "unit", "--widths", "32", "--log2-lr", "unit=0:101"],
    ["sweep", "--models", "unit", "--widths", "32", "--log2-lr", "unit=0:" + "9" * 30],
    ["sweep", "--models", "unit", "--widths", "32", "--span", "100"],
])
def test_the_command_refuses_them_before_making_a_directory(tmp_path, capsys, arguments):
    run_dir = tmp_path / "run"
    command, *rest = arguments
    assert main([command, "--config", "tiny", *rest, "--run-dir", str(run_dir),
                 "--quiet"]) == 2
    err = _one_line_error(capsys)
    assert any(word in err for word in ("float32", "digits", "2**")), err
    assert not run_dir.exists()


def test_a_key_written_twice_is_refused_with_its_line(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("training:\n  steps: 3\nmodel:\n  depth: 1\ntraining:\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"line 5, column 1: duplicate key 'training' "
                                          r"\(first at line 1\)"):
        load_config(path)
    with pytest.raises(ConfigError, match="training: duplicate key 'steps'"):
        load_config("tiny", ["training={steps: 1, steps: 2}"])
    assert main(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    assert "duplicate key 'training'" in _one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_merge_keys_may_still_override_what_they_bring(tmp_path):
    path = tmp_path / "merged.yaml"
    path.write_text("model: {depth: 1}\ntraining:\n  <<: {steps: 4, seed: 1}\n  steps: 6\n")
    config = load_config(path)
    assert (config.training.steps, config.training.seed) == (6, 1)
    assert config.model.depth == 1


@pytest.mark.parametrize("override, words", [
    ("mlm.learning_rates={fp32: abc}", "expected a number, got 'abc'"),
    ("mlm.learning_rates={bogus: 1.0}", "'bogus' is not a regime"),
    ("mlm.learning_rates={fp3: 1.0}", "did you mean 'fp32'"),
    ("mlm.learning_rates=5", "expected a mapping of regimes to learning rates"),
    ("mlm.learning_rates.fp32=1e39", "float32's range"),
    ("mlm.learning_rates.fp32=1e31", "2**-100 <= x <= 2**100"),
    ("mlm.data.x=1", "mlm.data is a single value, not a section"),
    ("mlm.stesp=3", "did you mean 'steps'"),
    (f"mlm.steps={HUGE}", "is too large"),
    ("mlm.steps=99999999999999999999", "integers are -2**63 .. 2**63 - 1"),
    ("mlm.attn_tau=1e7", "attn_tau must be at most 1e+06"),
])
def test_bert_settings_are_refused_as_cleanly(tmp_path, capsys, override, words):
    run_dir = tmp_path / "run"
    assert main(["compare", "--model", "bert", "--set", override, "--run-dir", str(run_dir),
                 "--quiet"]) == 2
    assert words in _one_line_error(capsys)
    assert not run_dir.exists()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_largest_learning_rate_and_weight_decay_diverge_cleanly(tmp_path, capsys, optimizer):
    """The bounds are ones the optimizer step can take: 2**100 with a weight decay of 2**20
    blows the weights up (exit 1, the divergence's own line), never float32's overflow."""
    status = main(["train", "--config", "tiny", "--set", "training.steps=3",
                   "training.warmup_steps=0", f"training.optimizer={optimizer}",
                   f"training.learning_rate={2.0**100!r}", f"training.weight_decay={2.0**20!r}",
                   "model.parametrization=u-mup", "--run-dir", str(tmp_path / "run"),
                   "--quiet"])
    err = capsys.readouterr().err
    assert status in (0, 1) and "internal error" not in err and "overflow" not in err, err


@pytest.mark.parametrize("override", [
    "ipu.layers_per_ipu=[" + ",".join(["1"] * 10000) + "]",
    "compare.regimes=[" + ",".join(["fp32"] * 10000) + "]",
    "ipu.available_memory_proportion=[" + ",".join(["0.5"] * 10000) + "]",
])
def test_a_long_list_is_shown_cut(override):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    assert len(str(info.value)) < 400 and "..." in str(info.value), str(info.value)[:400]
