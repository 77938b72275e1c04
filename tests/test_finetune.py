"""Fine-tuning a trained run on new text: the tokenizer rule, fresh rows, the fixed model."""
from __future__ import annotations

import pytest
import torch

from ipu_unit_scaling.config import ConfigError, load_config
from ipu_unit_scaling.data import CharTokenizer, load_corpus
from ipu_unit_scaling.finetune import (
    check_same_model,
    encode_with,
    extend_model_state,
    extend_tokenizer,
)


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
