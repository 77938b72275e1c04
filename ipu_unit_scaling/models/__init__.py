"""Example models built from the modules: the GPT (unit-scaled, u-μP or plain torch) and a
BERT-style encoder."""
from __future__ import annotations

from .gpt import GPT, GPTConfig, build_gpt, umup_decoder

__all__ = ["GPT", "GPTConfig", "build_gpt", "umup_decoder"]
