"""Fine-tuning a trained run on new text (``train --init-from RUN_DIR``): the rules.

- **Model.** The pretrained run's config fixes the model: every ``model`` key but ``dropout``
  keeps the pretrained value, and asking for another one is a config error.
- **Tokenizer.** Every character keeps its pretrained id. Characters of the new text that the
  pretrained tokenizer lacks are appended after them, in sorted order. Characters the new text
  lacks stay in the vocabulary (the model may still predict them).
- **Fresh rows.** Each new character gets a row in the token embedding and in the output head,
  both set to the mean of the pretrained rows: as an input it starts as an average character,
  and its logit starts at the average logit, neither a random spike nor a hole the loss would
  first have to climb out of. The rows then learn from the new text like all other weights.
- **Everything else** (optimizer, learning-rate schedule, step count, data order) starts
  afresh, as in any new run; the weights are the pretrained checkpoint's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .config_files import ConfigError
from .data import CharTokenizer, Corpus
from .run_config import Config

__all__ = [
    "FREE_MODEL_KEYS", "VOCABULARY_ROWS", "check_same_model", "extend_tokenizer",
    "encode_with", "extend_model_state",
]

# model keys a fine-tuning run may change: they shape no weight and no op.
FREE_MODEL_KEYS = ("dropout",)
# Parameters with one row per token id: the input embedding and the output head.
VOCABULARY_ROWS = ("embedding.weight", "head.weight")


def check_same_model(pretrained: Config, requested: Config, source: str,
                     keeper: str = "fine-tuning", why: str = "") -> None:
    """ConfigError naming each ``model`` key ``requested`` changes from the pretrained run
    (``keeper``: what keeps its model, a fine-tuning or a resumed run; ``why``: said after the
    saved value)."""
    before = dataclasses.asdict(pretrained.model)
    after = dataclasses.asdict(requested.model)
    errors = [
        (f"model.{key}", f"got {after.get(key)!r}, but {keeper} keeps the model of {source} "
                         f"({key} = {value!r}){why}; only {', '.join(FREE_MODEL_KEYS)} may "
                         "change")
        for key, value in before.items()
        if key not in FREE_MODEL_KEYS and after.get(key) != value
    ]
    if errors:
        raise ConfigError(errors)


def extend_tokenizer(base: CharTokenizer, chars: Sequence[str]) -> Tuple[CharTokenizer, List[str]]:
    """``base`` with the characters of ``chars`` it lacks appended in sorted order; returns
    the extended tokenizer and the added characters. Pretrained ids are unchanged."""
    known = set(base.chars)
    added = sorted(set(chars) - known)
    return CharTokenizer(list(base.chars) + added), added


def encode_with(corpus: Corpus, tokenizer: CharTokenizer) -> Corpus:
    """``corpus`` re-encoded with ``tokenizer``, which must hold every character of it."""
    remap = torch.tensor([tokenizer.chars.index(c) for c in corpus.tokenizer.chars],
                         dtype=torch.long)
    return Corpus(tokenizer, remap[corpus.train], remap[corpus.val], corpus.source,
                  corpus.sha256)


def extend_model_state(state: Dict[str, Any], vocab_size: int) -> Dict[str, Any]:
    """A copy of the model ``state`` with :data:`VOCABULARY_ROWS` grown to ``vocab_size`` rows,
    the new rows the mean of the pretrained ones (see the module's notes)."""
    result = dict(state)
    for name in VOCABULARY_ROWS:
        weight = state[name]
        missing = vocab_size - weight.shape[0]
        if missing < 0:
            raise ValueError(f"{name} has {weight.shape[0]} rows, more than {vocab_size}")
        if missing:
            mean = weight.mean(dim=0, keepdim=True)
            result[name] = torch.cat([weight, mean.expand(missing, -1)]).contiguous()
    return result
