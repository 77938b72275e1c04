"""How much host memory one training step of a config needs, checked before anything is built.

The estimate counts float32 bytes: weights with their gradients, optimizer state and the
per-step scaled copies that unit-scaled and FP8 layers make, the activations one micro-batch
keeps for its backward pass (attention scores included: they grow with the square of the
sequence length), the logits a call returns, and the token batches. It is meant to be right
within a factor of two, which is enough to refuse a config that cannot fit long before
allocation fails half-way through a step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..models.gpt import GPTConfig
    from .run_config import Config

__all__ = ["MemoryEstimate", "estimate_step_memory", "check_memory", "machine_memory",
           "format_bytes"]

FLOAT = 4
INDEX = 8


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per part of one training step (Python ints: a hostile config cannot overflow)."""

    parameters: int  # weights, gradients, optimizer state and scaled copies
    activations: int  # what one micro-batch keeps for backward, at its peak
    batches: int  # token ids of a call and of the validation set, and the returned logits

    @property
    def total(self) -> int:
        return self.parameters + self.activations + self.batches

    def describe(self) -> str:
        return (f"{format_bytes(self.total)} (weights and optimizer "
                f"{format_bytes(self.parameters)}, activations {format_bytes(self.activations)}, "
                f"batches {format_bytes(self.batches)})")


def parameter_count(m: GPTConfig) -> int:
    """Parameters of the GPT of the model section ``m`` (``models.build_gpt``), unbuilt."""
    hidden, inner = m.hidden_size, m.mlp_expansion * m.hidden_size
    norm = hidden * (2 if m.bias else 1)
    attention = 4 * hidden * hidden + (4 * hidden if m.bias else 0)
    mlp = 2 * hidden * inner + ((inner + hidden) if m.bias else 0)
    layer = 2 * norm + attention + mlp
    return (m.vocab_size + m.seq_len) * hidden + m.depth * layer + norm + hidden * m.vocab_size


def estimate_step_memory(config: Config) -> MemoryEstimate:
    """The host memory one training step of ``config`` needs (see the module docstring)."""
    m, training = config.model, config.training
    optimizer_copies = {"sgd": 0, "adam": 2, "adamw": 2}.get(training.optimizer, 2)
    # weight, gradient, optimizer state, and the scaled or cast copy each layer makes per step
    parameters = parameter_count(m) * FLOAT * (3 + optimizer_copies)

    tokens = config.micro_batch_size * m.seq_len
    hidden, inner = m.hidden_size, m.mlp_expansion * m.hidden_size
    # per token and layer: norms, q/k/v, attention output, projections, residual halves, MLP
    per_token_layer = 10 * hidden + 3 * inner
    # scores and probabilities, kept per head for every pair of positions
    attention = 2 * config.micro_batch_size * m.heads * m.seq_len * m.seq_len
    low_precision = config.precision.dtype in ("fp8", "fp16")
    if low_precision and config.precision.fp8.attention:
        attention *= 2  # the cast copies of attention's operands
    # FP8 and FP16 layers keep cast copies of their inputs next to the inputs
    per_token_layer = per_token_layer * 3 // 2 if low_precision else per_token_layer
    activations = FLOAT * m.depth * (tokens * per_token_layer + attention)
    activations += FLOAT * 3 * tokens * (m.vocab_size + hidden)  # logits, softmax, gradient

    call_tokens = config.samples_per_call * m.seq_len
    batches = INDEX * 3 * call_tokens + FLOAT * call_tokens * m.vocab_size
    batches += INDEX * 2 * training.eval_batches * training.batch_size * m.seq_len
    return MemoryEstimate(parameters, activations, batches)


def check_memory(config: Config, host_activations: bool = True) -> str:
    """Refuse (RunError) a config whose training step cannot fit in this machine's memory;
    else say what it needs. Without ``host_activations`` (an IPU holds them) they are not
    counted against the host."""
    from .run_directory import RunError

    if config.model.factory is not None:  # the estimate counts the package's GPT
        return f"memory for one step: not estimated for a given model ({config.model.factory})"
    estimate = estimate_step_memory(config)
    needed = estimate.total if host_activations else estimate.total - estimate.activations
    available = machine_memory()
    if available is not None and needed > available:
        raise RunError(
            f"one training step needs about {estimate.describe()}, more than the "
            f"{format_bytes(available)} of this machine; reduce model.hidden_size, "
            "model.seq_len, model.depth or training.batch_size"
        )
    of = f" of {format_bytes(available)}" if available is not None else ""
    return f"memory for one step: about {format_bytes(estimate.total)}{of}"


def machine_memory() -> Optional[int]:
    """Physical memory, or the container's limit where lower; None where neither is known."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    limits = [limit for limit in limits if limit > 0]
    return min(limits) if limits else None


def format_bytes(size: int) -> str:
    if size >= 1024**7:  # beyond any machine; also keeps float() from overflowing
        return f"about 2^{size.bit_length() - 1} bytes"
    value = float(size)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} bytes"
