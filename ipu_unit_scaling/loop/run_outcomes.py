"""How a run ends: its summary (``summary.json``), divergence, and the errors a stopped or
diverged run raises.
"""
from __future__ import annotations

import math
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..training.run_directory import (
    SUMMARY_FILE,
    atomic_write,
)
from .tasks import CAUSAL_LM


class TrainingDiverged(RuntimeError):
    """The loss or the weights became non-finite, or a loss passed :func:`divergence_bound`;
    nothing was saved after the last step whose weights were good."""

    def __init__(self, message: str, step: int, checkpoint: Optional[Path]):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class TrainingInterrupted(RuntimeError):
    """SIGINT (Ctrl-C) or SIGTERM: the run stopped at a step boundary (with a checkpoint) or,
    at a second signal, mid-step (without). ``signum`` is the signal's number."""

    def __init__(self, message: str, step: int, checkpoint: Optional[Path],
                 signum: int = signal.SIGINT):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint
        self.signum = int(signum)


class StopSignal(KeyboardInterrupt):
    """A signal that stops at once what it interrupts, as Ctrl-C's KeyboardInterrupt does;
    ``signum`` says which (SIGTERM's default would kill the process without a word)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


# Nats above the uniform baseline ln V past which a loss is divergence (see the module doc).
DIVERGENCE_MARGIN = 10.0


def divergence_bound(vocab_size: int) -> float:
    """The largest loss of a run that has not diverged: ln V + ``DIVERGENCE_MARGIN``."""
    return math.log(max(1, vocab_size)) + DIVERGENCE_MARGIN


@dataclass
class RunSummary:
    """What ``summary.json`` holds."""

    run_dir: str
    status: str  # completed, diverged, interrupted, or unfinished (written at each checkpoint)
    steps: int
    final_train_loss: Optional[float]
    final_val_loss: Optional[float]
    best_val_loss: Optional[float]
    unigram_baseline: float
    uniform_baseline: float
    tokens_per_s: float
    elapsed_s: float
    backend: str
    data: str
    message: str = ""
    val_curve: List[Tuple[int, float]] = field(default_factory=list)
    data_sha256: str = ""  # of the text trained on: compare reuses a run only on the same text
    init_from: Optional[str] = None  # the pretrained run a fine-tuning run started from
    # The step of the run's last checkpoint, None if it never saved one: what tells a run that
    # may start afresh from one whose checkpoint.pt went missing.
    checkpoint_step: Optional[int] = None
    task: str = CAUSAL_LM
    model: str = ""  # the model kind: plain, unit or u-mup
    learning_rate: Optional[float] = None  # the schedule's peak
    # The task's other validation metrics at the last evaluation, e.g. {"accuracy": 0.41}.
    final_val_metrics: Dict[str, float] = field(default_factory=dict)


def write_summary(summary: RunSummary) -> None:
    import json

    atomic_write(Path(summary.run_dir) / SUMMARY_FILE,
                 json.dumps(asdict(summary), indent=2).encode())


def exact_repr(value: Optional[float]) -> str:
    """A number as metrics.csv writes it: its repr, exact to the bit; empty for None."""
    # repr round-trips exactly, so runs can be compared bit for bit from the CSV.
    return "" if value is None else repr(float(value))
