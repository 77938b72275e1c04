"""The embedded corpus, character tokenizer, split, batches and unigram baseline."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ipu_unit_scaling.training.data import (
    CharTokenizer,
    DataError,
    embedded_corpus,
    get_batch,
    load_corpus,
    read_text_file,
    unigram_cross_entropy,
)


def test_embedded_corpus_is_english_text_in_a_fixed_order():
    text = embedded_corpus()
    assert len(text) > 100_000
    assert embedded_corpus() == text
    assert "the" in text and "function" in text


def test_tokenizer_vocabulary_is_sorted_and_round_trips(tmp_path):
    text = "hello, wörld\n"
    tokenizer = CharTokenizer.from_text(text)
    assert tokenizer.chars == sorted(set(text))
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.long
    assert [tokenizer.chars[i] for i in ids.tolist()] == list(text)
    assert tokenizer.decode(ids) == text
    tokenizer.save(tmp_path / "tok.json")
    assert CharTokenizer.load(tmp_path / "tok.json").chars == tokenizer.chars
    with pytest.raises(DataError, match="not in the tokenizer"):
        tokenizer.encode("z")


def test_split_is_the_tail_and_deterministic(tmp_path):
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), 0.1, seq_len=8)
    assert len(corpus.train) == 900 and len(corpus.val) == 100
    assert corpus.tokenizer.decode(corpus.val) == text[900:]
    assert corpus.tokenizer.decode(corpus.train) == text[:900]
    again = load_corpus(str(path), 0.1, seq_len=8)
    assert torch.equal(again.train, corpus.train) and again.sha256 == corpus.sha256


def test_batches_are_seeded_windows_with_shifted_labels():
    data = torch.arange(500)
    inputs, labels = get_batch(data, 6, 10, torch.Generator().manual_seed(3))
    assert inputs.shape == labels.shape == (6, 10)
    for row_in, row_label in zip(inputs, labels):
        start = int(row_in[0])
        assert torch.equal(row_in, data[start : start + 10])
        assert torch.equal(row_label, data[start + 1 : start + 11])
    again, _ = get_batch(data, 6, 10, torch.Generator().manual_seed(3))
    assert torch.equal(again, inputs)


def test_unigram_baseline_matches_a_direct_count():
    train_text, val_text = "aaabbc" * 10, "abcaab"
    vocab = sorted(set(train_text))
    counts = Counter(train_text)
    total = len(train_text) + len(vocab)  # add-one smoothing
    expected = -sum(math.log((counts[c] + 1) / total) for c in val_text) / len(val_text)
    tokenizer = CharTokenizer(vocab)
    got = unigram_cross_entropy(tokenizer.encode(train_text), tokenizer.encode(val_text), 3)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"caf\xe9 au lait", "not UTF-8 text.*0xe9 at offset 3"),
    ],
)
def test_unusable_files_give_one_clear_error(tmp_path, content, message):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_text_file(path)


def test_text_shorter_than_a_sequence_is_refused(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 100, encoding="utf-8")
    with pytest.raises(DataError, match="too short for one sequence of 64"):
        load_corpus(str(path), 0.1, seq_len=64)
