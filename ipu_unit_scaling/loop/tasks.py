"""What the training loop trains: a task brings its model, its batches and its loss.

The loop of :mod:`.training_loop` is the same for every task: run directory, checkpoints, resume,
locks, signals, evaluation steps, metrics, plots. A task says only what differs:

- :meth:`Task.build_model` the model ``config`` describes, called once after
  ``torch.manual_seed(training.seed)``;
- :meth:`Task.train_batch` the inputs and labels of one training-model call, drawn from the
  loop's generator: the generator's state is the data position, saved in every checkpoint, so
  a resumed run draws the batches the uninterrupted one would have;
- :meth:`Task.validation_batches` the fixed batches every evaluation scores;
- :meth:`Task.evaluate` the validation loss (what the divergence rule and checkpoints judge),
  with any other metric the task reports (a ``val_<name>`` column of ``metrics.csv``).

Tasks:

- :class:`CausalLM` (``causal-lm``): the character-level GPT predicting each next character;
  what every run trains unless told otherwise;
- :class:`MaskedLM` (``masked-lm``): the BERT-style encoder (:mod:`.masked_lm`) predicting masked
  characters of padded sequences, scored by loss and accuracy over the masked positions.

A run of a task other than the causal LM records it in ``task.json`` (name and settings), so
that a resume, and every reader of the run, knows what it trained; a run without that file
trained the causal LM.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Tuple

import torch
from torch import Tensor, nn

from ..training.config_files import ConfigError
from ..training.run_config import Config
from ..training.run_directory import TASK_FILE, RunError

__all__ = ["Task", "CausalLM", "MaskedLM", "CAUSAL_LM", "MASKED_LM", "TASK_NAMES",
           "task_from_settings", "read_task"]

Batch = Tuple[Tensor, Tensor]

CAUSAL_LM = "causal-lm"
MASKED_LM = "masked-lm"


class Task:
    """What one kind of training run trains (see the module notes)."""

    name: ClassVar[str]
    model_name: ClassVar[str]  # how figures name the model ("GPT", ...)
    # Validation metrics besides the loss, by the names evaluate() gives them.
    extra_metrics: ClassVar[Tuple[str, ...]] = ()

    def settings(self) -> Dict[str, Any]:
        """The task's name and settings, as ``task.json`` and checkpoints record them."""
        return {"name": self.name}

    def check(self, config: Config, backend: str) -> None:
        """ConfigError naming what of ``config`` (or the backend) the task cannot train."""

    def build_model(self, config: Config) -> nn.Module:
        raise NotImplementedError

    def train_batch(self, tokens: Tensor, config: Config, generator: torch.Generator) -> Batch:
        """Inputs and labels of one call of the training model: ``config.samples_per_call``
        rows, from ``generator`` only."""
        raise NotImplementedError

    def validation_batches(self, tokens: Tensor, config: Config) -> List[Batch]:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, batches: List[Batch]) -> Dict[str, float]:
        """``loss`` (NaN when an FP8 cast met a non-finite value), and each of
        ``extra_metrics``, of ``model`` (in eval mode, without gradients) on ``batches``."""
        raise NotImplementedError

    @property
    def metric_columns(self) -> Tuple[str, ...]:
        """The columns ``extra_metrics`` add to ``metrics.csv``."""
        return tuple(f"val_{metric}" for metric in self.extra_metrics)


class CausalLM(Task):
    """The character-level GPT of the config, predicting every next character."""

    name = CAUSAL_LM
    model_name = "GPT"

    def check(self, config: Config, backend: str) -> None:
        from ..backends import capabilities
        from ..training.given_model import check_given_model

        check_given_model(config, backend, capabilities(backend, config.ipu).trains_given_model)

    def build_model(self, config: Config) -> nn.Module:
        from ..training.precision import build_model

        return build_model(config)

    def train_batch(self, tokens: Tensor, config: Config, generator: torch.Generator) -> Batch:
        from ..training.data import get_batch

        return get_batch(tokens, config.samples_per_call, config.model.seq_len, generator)

    def validation_batches(self, tokens: Tensor, config: Config) -> List[Batch]:
        from ..training.inference import validation_batches

        return validation_batches(tokens, config)

    def evaluate(self, model: nn.Module, batches: List[Batch]) -> Dict[str, float]:
        from ..training.inference import mean_loss

        return {"loss": mean_loss(model, batches)}


@dataclass(frozen=True)
class MaskedLM(Task):
    """The BERT-style encoder of :mod:`.masked_lm`, trained with masked-LM.

    The model's shape is the config's (``model.hidden_size``, ``depth``, ``heads``,
    ``mlp_expansion``, ``seq_len``, ``attn_tau``, ``mlp_tau``, ``dropout``), plain or
    unit-scaled by ``model.unit_scaled``, in ``precision``; its vocabulary is the text's
    characters plus a padding and a mask token. Sequences are cut to a random length between
    ``min_len`` and ``model.seq_len`` and padded; ``mask_prob`` of the real tokens are targets
    (BERT's 80/10/10 masking). Validation batches come from a generator of their own, seeded
    ``training.seed + 10000``.
    """

    min_len: int = 24
    mask_prob: float = 0.15

    name: ClassVar[str] = MASKED_LM
    model_name: ClassVar[str] = "BERT-style encoder"
    extra_metrics: ClassVar[Tuple[str, ...]] = ("accuracy",)

    def settings(self) -> Dict[str, Any]:
        return {"name": self.name, "min_len": self.min_len, "mask_prob": self.mask_prob}

    def check(self, config: Config, backend: str) -> None:
        errors = []
        model = config.model
        if model.parametrization == "u-mup":
            errors.append(("model.parametrization", "the BERT-style encoder is plain or "
                                                    "unit-scaled; it has no u-μP form"))
        if model.bias:
            errors.append(("model.bias", "the BERT-style encoder is bias-free"))
        if model.factory is not None:
            errors.append(("model.factory", "the masked LM trains the BERT-style encoder; a "
                                            "given model trains as a causal LM"))
        if not 1 <= self.min_len <= model.seq_len:
            errors.append(("model.seq_len", f"got {model.seq_len}; the masked LM's min_len "
                                            f"({self.min_len}) must be in [1, seq_len]"))
        if not 0 < self.mask_prob < 1:
            errors.append(("", f"the masked LM's mask_prob must be in (0, 1), got "
                               f"{self.mask_prob!r}"))
        from ..backends import capabilities

        if not capabilities(backend, config.ipu).trains_masked_lm:
            errors.append(("backend", f"{backend} trains the GPT written in PopXL; a masked LM "
                                      "trains on cpu, emulator, ipu or ipu_model"))
        if errors:
            raise ConfigError(errors)

    def build_model(self, config: Config) -> nn.Module:
        from .masked_lm import encoder_from_config

        return encoder_from_config(config)

    def train_batch(self, tokens: Tensor, config: Config, generator: torch.Generator) -> Batch:
        from .masked_lm import masked_batch

        return masked_batch(tokens, config.model.vocab_size, config.samples_per_call,
                            config.model.seq_len, self.min_len, self.mask_prob, generator)

    def validation_batches(self, tokens: Tensor, config: Config) -> List[Batch]:
        from .masked_lm import masked_batch

        generator = torch.Generator().manual_seed(config.training.seed + 10_000)
        return [masked_batch(tokens, config.model.vocab_size, config.training.batch_size,
                             config.model.seq_len, self.min_len, self.mask_prob, generator)
                for _ in range(config.training.eval_batches)]

    def evaluate(self, model: nn.Module, batches: List[Batch]) -> Dict[str, float]:
        from .masked_lm import evaluate

        loss, accuracy = evaluate(model, batches)
        return {"loss": loss, "accuracy": accuracy}


TASK_NAMES = (CAUSAL_LM, MASKED_LM)


def task_from_settings(settings: Any) -> Task:
    """The task :meth:`Task.settings` describes; ValueError if it describes none."""
    if not isinstance(settings, dict):
        raise ValueError(f"expected a mapping, got {type(settings).__name__}")
    name = settings.get("name")
    rest = {key: value for key, value in settings.items() if key != "name"}
    if name == CAUSAL_LM and not rest:
        return CausalLM()
    if name == MASKED_LM and set(rest) == {"min_len", "mask_prob"}:
        min_len, mask_prob = rest["min_len"], rest["mask_prob"]
        if isinstance(min_len, int) and not isinstance(min_len, bool) and \
                isinstance(mask_prob, (int, float)) and not isinstance(mask_prob, bool):
            return MaskedLM(min_len, float(mask_prob))
    raise ValueError(f"not a task: {json.dumps(settings)[:200]} (tasks: "
                     f"{', '.join(TASK_NAMES)})")


def read_task(run_dir: Path, action: str = "resume") -> Task:
    """The task the run in ``run_dir`` trains: its ``task.json``, or the causal LM where there
    is none; RunError (`"cannot <action> ..."`) if the file cannot be read or names no task."""
    path = Path(run_dir) / TASK_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return CausalLM()
    except (OSError, UnicodeDecodeError) as error:
        raise RunError(f"cannot {action} {run_dir}: {TASK_FILE} cannot be read "
                       f"({getattr(error, 'strerror', None) or error})") from None
    try:
        return task_from_settings(json.loads(text))
    except (ValueError, RecursionError):
        raise RunError(f"cannot {action} {run_dir}: {TASK_FILE} is damaged") from None
