"""Fine-tuning a trained run on new text: the tokenizer rule, fresh rows, the fixed model."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import ONE_IPU, ROOT

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.apps.pretrained import open_run
from ipu_unit_scaling.loop import training_loop as train_module
from ipu_unit_scaling.loop.run_opening import load_run_config
from ipu_unit_scaling.loop.run_outcomes import TrainingInterrupted
from ipu_unit_scaling.loop.run_session import TrainingSession
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.config_files import ConfigError
from ipu_unit_scaling.training.data import CharTokenizer, load_corpus
from ipu_unit_scaling.training.finetune import (
    check_same_model,
    encode_with,
    extend_model_state,
    extend_tokenizer,
)
from ipu_unit_scaling.training.inference import PRECISIONS, mean_loss, precision_config
from ipu_unit_scaling.training.precision import regime_config
from ipu_unit_scaling.training.run_config import load_config
from ipu_unit_scaling.training.run_directory import RunError
from ipu_unit_scaling.training.run_records import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _weather_log():
    # scripts/ is not a package: load the generator of the README's fine-tuning text by path
    path = ROOT / "scripts" / "weather_log.py"
    spec = importlib.util.spec_from_file_location("weather_log", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.weather_log


weather_log = _weather_log()


def test_new_characters_extend_the_vocabulary_after_the_old_ids():
    base = CharTokenizer.from_text("hello world")
    extended, added = extend_tokenizer(base, "café olé")
    assert added == ["a", "c", "f", "é"]
    assert extended.chars[:base.vocab_size] == base.chars  # every old id is kept
    assert extended.encode("hello").tolist() == base.encode("hello").tolist()
    assert extend_tokenizer(base, "low")[0].chars == base.chars  # nothing new, nothing added
    # from nothing, the rule is the plain one: sorted characters
    assert extend_tokenizer(CharTokenizer([]), "banana")[0].chars == ["a", "b", "n"]


def test_a_corpus_re_encoded_with_the_extended_tokenizer_decodes_to_the_same_text(tmp_path):
    path = tmp_path / "text.txt"
    text = "une île, un été à Nîmes. " * 20
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), 0.2, 8)
    extended, _ = extend_tokenizer(CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,."),
                                   corpus.tokenizer.chars)
    encoded = encode_with(corpus, extended)
    assert encoded.tokenizer is extended and encoded.sha256 == corpus.sha256
    assert extended.decode(torch.cat([encoded.train, encoded.val])) == text


def test_fresh_rows_are_the_mean_of_the_pretrained_rows():
    torch.manual_seed(0)
    state = {"embedding.weight": torch.randn(5, 3), "head.weight": torch.randn(5, 3),
             "position_embedding.weight": torch.randn(4, 3)}
    grown = extend_model_state(state, 7)
    for name in ("embedding.weight", "head.weight"):
        assert grown[name].shape == (7, 3)
        assert torch.equal(grown[name][:5], state[name])
        assert torch.allclose(grown[name][5:], state[name].mean(0).expand(2, 3))
    assert grown["position_embedding.weight"] is state["position_embedding.weight"]
    assert state["embedding.weight"].shape == (5, 3)  # the input is left alone
    with pytest.raises(ValueError, match="more than"):
        extend_model_state(state, 4)


def test_only_dropout_of_the_model_may_change():
    pretrained = load_config("tiny")
    check_same_model(pretrained, load_config("tiny", ["model.dropout=0.1",
                                                      "training.steps=3"]), "runs/x")
    with pytest.raises(ConfigError) as error:
        check_same_model(pretrained, load_config("tiny", ["model.hidden_size=64",
                                                                   "model.heads=4"]),
                         "runs/x")
    assert [path for path, _ in error.value.errors] == ["model.hidden_size", "model.heads"]
    assert "keeps the model of runs/x (hidden_size = 32)" in error.value.errors[0][1]


# ------------------------------------------------------------------------------ end to end


def tiny(*overrides: str):
    return load_config("tiny", [
        *ONE_IPU,
        "training.steps=10", "training.eval_interval=10", "training.eval_batches=2", *overrides,
    ])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny plain FP32 run on the embedded corpus."""
    run_dir = tmp_path_factory.mktemp("pretrained") / "run"
    train(regime_config(tiny(), "fp32"), run_dir, quiet=True)
    return run_dir


@pytest.fixture(scope="module")
def new_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "weather.txt"
    path.write_text(weather_log(days=6), encoding="utf-8")
    return path


def fine_tuning_config(pretrained: Path, new_text: Path, *overrides: str):
    config = load_run_config(pretrained, ["training.steps=12", "training.warmup_steps=0",
                                          "training.eval_interval=12", *overrides])
    return replace(config, data=replace(config.data, path=str(new_text)))


@pytest.mark.parametrize("precision", ["fp32", "fp8-amax"])
def test_fine_tuning_lowers_the_loss_on_the_new_text_and_keeps_the_old_ids(
        pretrained, new_text, tmp_path, precision):
    config = precision_config(fine_tuning_config(pretrained, new_text), precision)
    summary = train(config, tmp_path / "ft", quiet=True, init_from=pretrained)
    (start_step, start), (end_step, end) = summary.val_curve[0], summary.val_curve[-1]
    assert (start_step, end_step) == (0, 12) and end < start - 0.3
    assert summary.init_from == str(pretrained)
    old = CharTokenizer.load(pretrained / "tokenizer.json")
    new = CharTokenizer.load(tmp_path / "ft" / "tokenizer.json")
    added = sorted(set(new_text.read_text(encoding="utf-8")) - set(old.chars))
    assert added and new.chars == old.chars + added  # old ids kept, new ones after them
    saved = load_run_config(tmp_path / "ft")
    assert saved.model.vocab_size == new.vocab_size
    assert (saved.precision.dtype, saved.precision.fp8.scaling)[: 1 + (precision != "fp32")] \
        == tuple(PRECISIONS[precision])[: 1 + (precision != "fp32")]


def test_fine_tuning_starts_from_the_pretrained_weights(pretrained, new_text, tmp_path):
    config = fine_tuning_config(pretrained, new_text, "training.steps=1")
    train(config, tmp_path / "ft", quiet=True, init_from=pretrained, log=lambda _: None)
    before = load_checkpoint(pretrained / "checkpoint.pt")["model"]
    # the first validation point (step 0) is that of the pretrained weights with fresh rows
    state = extend_model_state(before, CharTokenizer.load(tmp_path / "ft" / "tokenizer.json")
                               .vocab_size)
    run = open_run(tmp_path / "ft")
    model = run.model("fp32")
    model.load_state_dict(state)
    batches = run.validation_batches()
    with torch.no_grad():
        first = mean_loss(model, batches)
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert summary["val_curve"][0] == [0, first]


def test_a_fine_tuning_run_resumes_with_its_extended_tokenizer(pretrained, new_text, tmp_path):
    # a constant learning rate: three steps of a six-step run are those of a three-step run
    config = fine_tuning_config(pretrained, new_text, "training.steps=6",
                                "training.eval_interval=3", "training.schedule=constant")
    whole = train(config, tmp_path / "whole", quiet=True, init_from=pretrained)
    config = replace(config, training=replace(config.training, steps=3))
    train(config, tmp_path / "part", quiet=True, init_from=pretrained)
    resumed = train(None, tmp_path / "part", resume=True, overrides=["training.steps=6"],
                    quiet=True)
    assert resumed.val_curve == whole.val_curve  # bit for bit, the start included
    assert resumed.init_from == str(pretrained)


def test_a_fine_tuning_run_stopped_before_its_first_step_resumes_fine_tuning(
        pretrained, new_text, tmp_path, monkeypatch):
    config = fine_tuning_config(pretrained, new_text, "training.steps=2")
    whole = train(config, tmp_path / "whole", quiet=True, init_from=pretrained)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C twice during the first step

    with monkeypatch.context() as patch:
        patch.setattr(TrainingSession, "train_call", stopped)
        with pytest.raises(TrainingInterrupted, match="during step 1"):
            train(config, tmp_path / "part", quiet=True, init_from=pretrained)
    state = load_checkpoint(tmp_path / "part" / "checkpoint.pt")  # the start, at step 0
    assert state["step"] == 0 and state["init_from"] == str(pretrained)
    assert state["base_chars"] == CharTokenizer.load(pretrained / "tokenizer.json").chars
    resumed = train(None, tmp_path / "part", resume=True, quiet=True)
    assert resumed.val_curve == whole.val_curve


def test_a_fine_tuning_run_killed_before_its_first_checkpoint_resumes_fine_tuning(
        pretrained, new_text, tmp_path, monkeypatch):
    config = fine_tuning_config(pretrained, new_text, "training.steps=2")
    whole = train(config, tmp_path / "whole", quiet=True, init_from=pretrained)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands for a kill once the settings are written

    with monkeypatch.context() as patch:
        patch.setattr(train_module, "TrainingSession", killed)
        with pytest.raises(KeyboardInterrupt):
            train(config, tmp_path / "part", quiet=True, init_from=pretrained)
    assert not (tmp_path / "part" / "checkpoint.pt").exists()
    resumed = train(None, tmp_path / "part", resume=True, quiet=True)
    assert resumed.init_from == str(pretrained)
    assert load_run_config(tmp_path / "part").model.vocab_size == \
        load_run_config(tmp_path / "whole").model.vocab_size
    assert resumed.val_curve == whole.val_curve  # the fine-tune's, from its step 0
    assert resumed.final_train_loss == whole.final_train_loss


def test_fine_tuning_refuses_another_model_and_a_missing_run(pretrained, new_text, tmp_path):
    with pytest.raises(ConfigError, match="model.depth: got 3, but fine-tuning keeps"):
        train(fine_tuning_config(pretrained, new_text, "model.depth=3"), tmp_path / "a",
              quiet=True, init_from=pretrained)
    with pytest.raises(RunError, match="cannot fine-tune from .*nothing: it holds no"):
        train(tiny(), tmp_path / "b", quiet=True, init_from=tmp_path / "nothing")
    with pytest.raises(RunError, match="init_from is for new runs"):
        train(None, pretrained, resume=True, init_from=pretrained)


def test_cli_fine_tunes_in_fp8_amax_and_refuses_shape_changes(pretrained, new_text, tmp_path,
                                                              capsys):
    base = ["train", "--init-from", str(pretrained), "--data", str(new_text), "--quiet"]
    assert main(base + ["--run-dir", str(tmp_path / "ft"), "--set", "training.steps=2",
                        "precision.dtype=fp8", "precision.fp8.scaling=amax"]) == 0
    assert load_run_config(tmp_path / "ft").precision.dtype == "fp8"
    capsys.readouterr()
    for extra, message in [
        (["--set", "model.hidden_size=64"], "invalid config: model.hidden_size: got 64, but "
                                            "fine-tuning keeps the model of"),
        (["--set", "model.vocab_size=300"], "model.vocab_size: got 300"),
        (["--config", "tiny"], "--init-from fine-tunes with the pretrained run's config"),
        (["--resume", str(tmp_path / "ft")], "--resume continues a run with its own config"),
    ]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
