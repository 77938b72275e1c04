"""Example models built from the modules: the GPT (unit-scaled, u-μP or plain torch) and a
BERT-style encoder."""
from __future__ import annotations

from .gpt import GPTConfig, build_gpt

__all__ = ["GPTConfig", "build_gpt"]
