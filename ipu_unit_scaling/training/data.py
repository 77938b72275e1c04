"""Character-level text data: the embedded corpus, a tokenizer, the split and random batches.

The default corpus is the English help text that ships inside the Python standard library
(``pydoc_data.topics``), so training needs no download. Any UTF-8 text file can replace it.

The split is deterministic: the last ``val_fraction`` of the characters is the validation set.
Batches are random windows drawn with a seeded ``torch.Generator`` whose state is saved in
checkpoints, so a resumed run draws exactly the batches the uninterrupted run would have.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "DataError",
    "CharTokenizer",
    "Corpus",
    "embedded_corpus",
    "read_text_file",
    "load_corpus",
    "get_batch",
    "unigram_cross_entropy",
    "out_of_memory",
]

EMBEDDED_NAME = "pydoc_data.topics (Python standard library help text)"


class DataError(ValueError):
    """Text that cannot be trained on; the message says why in one line."""


def embedded_corpus() -> str:
    """The help topics of the Python standard library, in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some minimal Python builds strip pydoc_data
        raise DataError(
            "the embedded corpus (pydoc_data.topics) is missing from this Python; "
            "pass --data FILE with your own UTF-8 text"
        ) from error
    return "\n\n".join(topics[name] for name in sorted(topics))


def read_text_file(path: Union[str, Path]) -> str:
    """Read a UTF-8 text file, with one clear error for each way it can be unusable."""
    name = repr(str(path))
    try:
        path = Path(path)
        if not path.exists():
            raise DataError(f"data file {name} does not exist")
        if not path.is_file():
            raise DataError(f"data file {name} is not a regular file")
        size = path.stat().st_size
        _check_fits(name, size)
        raw = path.read_bytes()
    except MemoryError:
        raise _does_not_fit(name, f"{size} bytes") from None
    except OSError as error:
        raise DataError(f"cannot read data file {name}: {error.strerror or error}") from None
    except ValueError as error:  # a NUL byte in the name
        if isinstance(error, DataError):
            raise
        raise DataError(f"data file {name} is not a usable path: {error}") from None
    if not raw:
        raise DataError(f"data file {name} is empty")
    try:
        text = raw.decode("utf-8")
    except MemoryError:
        raise _does_not_fit(name, f"{len(raw)} bytes") from None
    except UnicodeDecodeError as error:
        raise DataError(
            f"data file {name} is not UTF-8 text (invalid byte 0x{raw[error.start]:02x} "
            f"at offset {error.start})"
        ) from None
    # A leading byte-order mark says how the file is encoded; it is not a character of the text.
    return text[1:] if text.startswith("\ufeff") else text


# Host bytes per byte of text while it is decoded and encoded: the bytes, the string (up to 4
# bytes a character), the list of ids (8) and the tensor of ids (8).
BYTES_PER_TEXT_BYTE = 21


def _check_fits(name: str, size: int) -> None:
    from .memory import format_bytes, machine_memory

    available = machine_memory()
    if available is not None and size * BYTES_PER_TEXT_BYTE > available:
        raise DataError(
            f"data file {name} has {format_bytes(size)}; reading and encoding it needs about "
            f"{format_bytes(size * BYTES_PER_TEXT_BYTE)}, more than the "
            f"{format_bytes(available)} of this machine"
        )


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: Python's MemoryError, or torch's CPU
    allocator refusing (a RuntimeError)."""
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def _does_not_fit(name: str, size: str) -> DataError:
    # The estimate fitted the machine (_check_fits) but its free memory ran out.
    return DataError(f"data {name} ({size}) does not fit in the free memory of this machine; "
                     "free memory or use a smaller file")


class CharTokenizer:
    """One token per character; ids follow the order of ``chars``: sorted for a new run, the
    pretrained ids then the new characters for a fine-tuning run (see ``finetune``)."""

    def __init__(self, chars: Sequence[str]):
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError("tokenizer characters must be distinct single characters")
        self.chars: List[str] = list(chars)
        self._ids: Dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as error:
            raise DataError(f"character {error.args[0]!r} is not in the tokenizer") from error
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: Union[torch.Tensor, Sequence[int]]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.chars[i] for i in values)

    def save(self, path: Union[str, Path]) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"kind": "char", "chars": self.chars}, handle, ensure_ascii=False)

    @classmethod
    def load(cls, path: Union[str, Path]) -> CharTokenizer:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if not isinstance(data, dict) or data.get("kind") != "char":
            raise DataError(f"{path} is not a character tokenizer file")
        return cls(data["chars"])


@dataclass
class Corpus:
    """Encoded train and validation splits of one text."""

    tokenizer: CharTokenizer
    train: torch.Tensor
    val: torch.Tensor
    source: str  # where the text came from, for messages and summaries
    sha256: str  # of the UTF-8 text: a resumed run checks it trains on the same data


def load_corpus(
    path: Optional[str],
    val_fraction: float,
    seq_len: int,
    tokenizer: Optional[CharTokenizer] = None,
) -> Corpus:
    """Read, tokenize and split the text at ``path`` (None: the embedded corpus).

    Both splits must hold at least one window of ``seq_len + 1`` characters (inputs plus the
    next-character labels). ``tokenizer`` (from a run being resumed) replaces a fresh one.
    """
    if path is None:
        text, source = embedded_corpus(), EMBEDDED_NAME
    else:
        text, source = read_text_file(os.path.expanduser(path)), str(path)
    if not text.strip():
        raise DataError(f"data {source!r} holds only whitespace")
    needed = seq_len + 1
    val_size = int(len(text) * val_fraction)
    train_size = len(text) - val_size
    if min(train_size, val_size) < needed:
        minimum = math.ceil(needed / min(val_fraction, 1.0 - val_fraction)) + 1
        raise DataError(
            f"data {source!r} has {len(text)} characters: too short for one sequence of "
            f"{seq_len} + 1 in both splits (val_fraction {val_fraction}); "
            f"it needs about {minimum} or more"
        )
    try:
        tokenizer = tokenizer or CharTokenizer.from_text(text)
        ids = tokenizer.encode(text)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    except (MemoryError, RuntimeError) as error:
        if not out_of_memory(error):
            raise
        raise _does_not_fit(repr(source), f"{len(text)} characters") from None
    return Corpus(tokenizer, ids[:train_size], ids[train_size:], source, digest)


def get_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``data``: inputs and the next-character labels."""
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


def unigram_cross_entropy(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats per character) on ``val`` of the training character frequencies.

    This is the loss of a model that ignores context. Counts get add-one smoothing so that a
    character seen only in validation costs a finite amount.
    """
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    log_probs = torch.log(counts / counts.sum())
    return float(-log_probs[val].mean())
