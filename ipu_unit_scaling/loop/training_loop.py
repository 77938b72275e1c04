"""The training loop behind ``ipu-unit-scaling train``, ``compare`` and ``compare --model bert``.

One loop trains every task (:mod:`.tasks`: the causal-LM GPT, the masked-LM encoder) on every
backend (:mod:`.backends`): a task brings its model, batches and loss, a backend its training
model; the run directory, checkpoints, resume, locks, signals, evaluation, metrics and figures
are the loop's. A run lives in one directory (see ``ipu_unit_scaling.training.run_directory`` for
how it is
written)::

    config.yaml      the resolved config (the model's vocabulary is the corpus's)
    tokenizer.json   the character vocabulary
    task.json        the task and its settings, for tasks other than the causal LM
    metrics.csv      one row per optimizer step; validation loss (and the task's other
                     validation metrics) on evaluation steps
    checkpoint.pt    model, optimizer, RNG states (the batch generator's is the data
                     position), step and progress, behind a checksum
    summary.json     final losses, baselines, throughput and how the run ended (while it
                     runs: its progress at its last checkpoint)
    loss.png         training and validation loss against the unigram baseline
    tensorboard/     the same scalars as TensorBoard event files, where TensorBoard is
                     installed (see :mod:`.tensorboard_log`)

Runs are deterministic on CPU for a given seed and thread count: a run resumed from a
checkpoint produces bit for bit the losses of the uninterrupted run.

A run has diverged when its loss is not finite or is more than ``DIVERGENCE_MARGIN`` nats above
the uniform baseline ln V (V the vocabulary size): ln V is what predicting every character
equally likely scores, and where the model starts; 10 nats above it the model gives the right
character, on average, 1/22,000 of the probability a blind guess gives it. No healthy run gets
there; one whose learning rate is far too large gets there within steps, and finite. A
checkpoint is written only after the weights it holds pass the same test on the validation
batches, so "the last good checkpoint" is one whose loss was sane.

SIGINT (Ctrl-C) and SIGTERM (``kill``, ``timeout``, job schedulers, container runtimes) stop a
run alike: at the next step boundary, with a checkpoint; a second one stops it at once.
"""
from __future__ import annotations

import copy
import math
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..backends import build_training_model, make_optimizer, select_backend
from ..backends.distributed import (
    agreed_stop,
    join_launched_world,
    launched_world_size,
    opened_by_rank_zero,
    writes_run_files,
)
from ..fp8 import NonFiniteAmaxError
from ..parametrization.mup_optimizers import set_learning_rate
from ..training.data import CharTokenizer, Corpus, DataError, load_corpus, unigram_cross_entropy
from ..training.finetune import check_same_model, encode_with, extend_model_state, extend_tokenizer
from ..training.given_model import KEYS_EARLIER_RUNS_LACK
from ..training.memory import check_memory
from ..training.precision import (
    MODEL_KINDS,
    REGIME_SETTINGS,
    FP16Linear,
    build_model,
    model_kind,
    regime_config,
    round_to_half,
    set_model_kind,
    simulate_fp16,
)
from ..training.run_config import (
    Config,
    ConfigError,
    TrainingConfig,
    config_from_dict,
    read_yaml_file,
    scheduled_learning_rate,
    validate,
    warmup_steps,
)
from ..training.run_directory import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRIC_FIELDS,
    METRICS_FILE,
    PLOT_FILE,
    SCALE_REPORT_FILE,
    SUMMARY_FILE,
    TASK_FILE,
    TENSORBOARD_DIR,
    TOKENIZER_FILE,
    MetricsLog,
    RunError,
    RunLock,
    UnwrittenMetricsLog,
    atomic_write,
    check_checkpoint_logged,
    keep_report_rows_up_to,
    leftovers,
    load_checkpoint,
    make_run_dir,
    metrics_up_to,
    not_a_directory,
    read_json,
    read_metrics,
    remove_temporaries,
    save_checkpoint,
    state_mismatch,
)
from ..training.tensorboard_log import TensorBoardLog
from .tasks import CAUSAL_LM, CausalLM, Task, read_task

__all__ = [
    "RunError",
    "TrainingDiverged",
    "TrainingInterrupted",
    "StopSignal",
    "DIVERGENCE_MARGIN",
    "divergence_bound",
    "RunSummary",
    "REGIME_SETTINGS",
    "regime_config",
    "MODEL_KINDS",
    "set_model_kind",
    "model_kind",
    "simulate_fp16",
    "round_to_half",
    "FP16Linear",
    "build_model",
    "save_checkpoint",
    "load_checkpoint",
    "load_run_config",
    "read_tokenizer",
    "resolved_config",
    "train",
    "read_metrics",
    "CONFIG_FILE", "TOKENIZER_FILE", "METRICS_FILE", "CHECKPOINT_FILE", "SUMMARY_FILE",
    "PLOT_FILE", "METRIC_FIELDS",
]


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


# ------------------------------------------------------------------------ opening a run

# Backends whose activations live in IPU memory, not the host's (the IPU Model and the
# emulator simulate on the host).
_ON_IPU = ("ipu", "popxl")


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


@dataclass
class _Run:
    """A run directory opened for training: settings, data and the checkpoint to resume."""

    run_dir: Path
    config: Config
    corpus: Corpus
    backend: str
    state: Optional[Dict[str, Any]]
    notes: List[str]  # said once before the first step
    # Fine-tuning: the pretrained weights to start from, its tokenizer's characters and its
    # directory (kept in every checkpoint, so that a resume checks the extended tokenizer).
    weights: Optional[Dict[str, Any]] = None
    base_chars: List[str] = field(default_factory=list)
    init_from: Optional[str] = None
    task: Task = field(default_factory=CausalLM)
    # The pretrained checkpoint's step and training loss, checked against its run's log once
    # its weights are known to fit.
    init_checkpoint: Dict[str, Any] = field(default_factory=dict)


def load_run_config(
    run_dir: Path, overrides: Sequence[str] = (), action: str = "resume"
) -> Config:
    """The resolved config saved in ``run_dir``, with ``section.key=value`` overrides.

    A missing, empty, damaged or incomplete ``config.yaml`` is a RunError naming it: a resume
    must never fall back to defaults for settings the run did not save. ``action`` says in the
    message what could not be done ("resume", "evaluate", ...).
    """
    from ..training.run_config import apply_override

    path = Path(run_dir) / CONFIG_FILE
    refuse = f"cannot {action} {run_dir}: {CONFIG_FILE}"
    if not path.is_file():
        raise RunError(f"{refuse} is missing")
    try:
        raw = read_yaml_file(path, "run config")
        if raw is None:
            raise RunError(f"{refuse} is empty")
        if not isinstance(raw, dict):
            raise RunError(f"{refuse} is damaged (not a mapping)")
        missing = [key for key in _missing_keys(raw, Config().to_dict())
                   if key not in KEYS_EARLIER_RUNS_LACK]
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise RunError(f"{refuse} is incomplete (no {shown})")
        validate(config_from_dict(raw))
    except ConfigError as error:
        problems = "; ".join(f"{p}: {m}" if p else m for p, m in error.errors)
        raise RunError(f"{refuse} is damaged: {' '.join(problems.split())}") from None
    if action != "resume":
        task = read_task(run_dir, action)
        if task.name != CAUSAL_LM:
            raise RunError(f"cannot {action} {run_dir}: it trained a {task.name} "
                           f"{task.model_name} ({TASK_FILE}); {action} takes causal-LM runs")
    for override in overrides:
        apply_override(raw, override)
    config = config_from_dict(raw)
    validate(config)
    return config


def _missing_keys(raw: Dict[str, Any], full: Dict[str, Any], prefix: str = "") -> List[str]:
    missing = []
    for key, value in full.items():
        if key not in raw:
            missing.append(prefix + key)
        # (learning_rates is a value: a partial mapping of it is complete)
        elif isinstance(value, dict) and isinstance(raw[key], dict) and key != "learning_rates":
            missing += _missing_keys(raw[key], value, prefix + key + ".")
    return missing


def resolved_config(config: Config, corpus: Corpus) -> Config:
    """``config`` as a run on ``corpus`` saves it: the vocabulary is the corpus's characters."""
    vocab = corpus.tokenizer.vocab_size
    if vocab > config.model.vocab_size:
        raise DataError(
            f"{corpus.source} has {vocab} distinct characters but model.vocab_size is "
            f"{config.model.vocab_size}; raise model.vocab_size"
        )
    config = copy.deepcopy(config)
    config.model.vocab_size = vocab
    return config


def _open_new(config: Config, run_dir: Path, backend: str, task: Task,
              init_from: Optional[Path] = None) -> _Run:
    """A fresh run of ``task`` in an empty directory, or in one left by a run that never saved
    a checkpoint (which is started afresh: nothing of it could be continued); with
    ``init_from``, a fine-tuning run starting from that run's checkpoint."""
    old = leftovers(run_dir)
    if any(path.name == CHECKPOINT_FILE for path in old):
        raise RunError(
            f"run directory {run_dir} holds the checkpoint of an earlier run; continue it with "
            f"--resume {run_dir} or choose another --run-dir"
        )
    saved = _checkpoint_evidence(run_dir)
    if saved:
        raise RunError(f"run directory {run_dir} holds an earlier run whose {CHECKPOINT_FILE} "
                       f"is missing ({saved}); nothing was changed: choose another --run-dir")
    if init_from is None:
        corpus = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len)
        run = _Run(run_dir, resolved_config(config, corpus), corpus, backend, None, [],
                   task=task)
    else:
        if task.name != CAUSAL_LM:
            raise RunError(f"fine-tuning trains the causal LM, not a {task.name}")
        run = _fine_tuning(config, run_dir, backend, Path(init_from))
    run.notes.insert(0, check_memory(run.config, host_activations=backend not in _ON_IPU))
    if old:
        run.notes.append(f"{run_dir} held a run that never saved a checkpoint; starting afresh")
    _remove(old)
    _write_settings(run_dir, run.config, run.corpus, task)
    return run


def _fine_tuning(config: Config, run_dir: Path, backend: str, init_from: Path) -> _Run:
    """A new run of ``config`` on its data, from the weights of the run in ``init_from``, with
    the rules of :mod:`.finetune` (the same model, the tokenizer extended)."""
    action = "fine-tune from"
    if not (init_from / CHECKPOINT_FILE).is_file():
        raise RunError(f"cannot {action} {init_from}: it holds no {CHECKPOINT_FILE}")
    check_same_model(load_run_config(init_from, (), action), config, str(init_from))
    state = load_checkpoint(init_from / CHECKPOINT_FILE)
    base = read_tokenizer(init_from, action, state)
    if base.vocab_size != config.model.vocab_size:
        raise RunError(f"cannot {action} {init_from}: its {TOKENIZER_FILE} does not fit its "
                       f"model ({base.vocab_size} characters, model.vocab_size "
                       f"{config.model.vocab_size})")
    text = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len)
    tokenizer, added = extend_tokenizer(base, text.tokenizer.chars)
    config = copy.deepcopy(config)
    config.model.vocab_size = tokenizer.vocab_size
    if added:
        shown = "".join(added[:20]) + ("..." if len(added) > 20 else "")
        note = (f"{len(added)} new characters ({shown!r}) extend its {base.vocab_size}; their "
                "embedding and head rows start as the mean of the pretrained rows")
    else:
        note = f"its {base.vocab_size} characters cover the new text"
    return _Run(
        run_dir, config, encode_with(text, tokenizer), backend, None,
        [f"fine-tuning {init_from} (step {int(state['step'])}): {note}"],
        weights=extend_model_state(state["model"], tokenizer.vocab_size),
        base_chars=list(base.chars), init_from=str(init_from),
        init_checkpoint={key: state.get(key) for key in ("step", "last_train_loss")},
    )


def _checkpoint_evidence(run_dir: Path) -> str:
    """Why the run in ``run_dir`` is known to have saved a checkpoint, or "" if it never did.

    Every checkpoint is followed by a ``summary.json`` naming its step, and a run that never
    saved one leaves no summary or one whose ``checkpoint_step`` is null. Anything else (a
    summary of an earlier version, or one that cannot be read) counts as a checkpointed run:
    starting afresh would overwrite it.
    """
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return ""
    summary = read_json(path)
    if summary is None:
        return f"its {SUMMARY_FILE} cannot be read to tell whether it ever saved one"
    if "checkpoint_step" in summary and summary["checkpoint_step"] is None:
        return ""
    status, steps = summary.get("status", "unknown"), summary.get("steps", "?")
    step = summary.get("checkpoint_step")
    saved = f"checkpoint at step {step}" if step is not None else "checkpointed"
    return f"its {SUMMARY_FILE} records a {status} run of {steps} steps, {saved}"


def _open_resumed(config: Config, run_dir: Path, backend: str, task: Task) -> _Run:
    """The run of ``task`` in ``run_dir`` at its checkpoint, every artefact checked before
    anything runs."""
    checkpoint_path = run_dir / CHECKPOINT_FILE
    if not checkpoint_path.exists():
        saved = _checkpoint_evidence(run_dir)
        if saved:
            raise RunError(f"cannot resume {run_dir}: {CHECKPOINT_FILE} is missing, but "
                           f"{saved}; nothing was changed: restore the checkpoint, or train "
                           "again in another --run-dir")
        # Stopped before its first checkpoint: nothing to continue, so from step 0.
        run = _open_new(config, run_dir, backend, task)
        run.notes[1:] = [f"{run_dir} has no checkpoint: the run never saved one; training "
                         "from step 0 with its saved config"]
        return run
    state = load_checkpoint(checkpoint_path)
    saved_tokenizer = read_tokenizer(run_dir, "resume", state)
    trained = state.get("task", {"name": CAUSAL_LM})  # (earlier versions trained only that)
    if trained != task.settings():
        raise RunError(f"cannot resume {run_dir}: its {CHECKPOINT_FILE} trained {trained}, its "
                       f"{TASK_FILE} says {task.settings()} (no {TASK_FILE}: the causal LM)")
    corpus = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len)
    if state.get("data_sha256") != corpus.sha256:
        raise RunError(f"cannot resume {run_dir}: {corpus.source} is not the text it trained on")
    # The tokenizer rule: a pretrained run's characters (none for a run from scratch), then
    # the text's characters it lacks, in sorted order.
    base_chars = state.get("base_chars") or []
    try:
        expected, _ = extend_tokenizer(CharTokenizer(base_chars), corpus.tokenizer.chars)
    except (TypeError, ValueError):
        raise RunError(f"cannot resume {run_dir}: {CHECKPOINT_FILE} is damaged") from None
    if saved_tokenizer.chars != expected.chars:
        raise RunError(f"cannot resume {run_dir}: {TOKENIZER_FILE} does not match its data")
    corpus = encode_with(corpus, saved_tokenizer)
    config = resolved_config(config, corpus)
    step, steps = int(state["step"]), config.training.steps
    if step > steps:
        raise RunError(
            f"cannot resume {run_dir}: its checkpoint is at step {step}, beyond "
            f"training.steps = {steps}; set training.steps higher to train longer"
        )
    iterations = config.ipu.device_iterations
    if (steps - step) % iterations:
        raise RunError(
            f"cannot resume {run_dir} at step {step}: the {steps - step} remaining steps are "
            f"not a multiple of ipu.device_iterations ({iterations})"
        )
    notes = [check_memory(config, host_activations=backend not in _ON_IPU)]
    schedule_note = _schedule_change(state, run_dir, config.training, step)
    if schedule_note:
        notes.append(schedule_note)
    # The directory is rewritten (metrics cut back to the checkpoint, the settings of this
    # resume) only once the checkpoint has loaded into this config's model: a refused resume
    # changes nothing.
    return _Run(run_dir, config, corpus, backend, state, notes, base_chars=list(base_chars),
                init_from=state.get("init_from"), task=task)


def _rewrite_for_resume(run: _Run, step: int) -> None:
    atomic_write(run.run_dir / METRICS_FILE,
                 metrics_up_to(run.run_dir, step, METRIC_FIELDS + run.task.metric_columns))
    keep_report_rows_up_to(run.run_dir / SCALE_REPORT_FILE, step)
    _write_settings(run.run_dir, run.config, run.corpus, run.task)


# The settings the learning rate of a step is a function of (with the step).
SCHEDULE_KEYS = ("steps", "warmup_steps", "learning_rate", "schedule")


def _schedule_settings(training: TrainingConfig) -> Dict[str, Any]:
    return {key: getattr(training, key) for key in SCHEDULE_KEYS}


def _schedule_change(state: Dict[str, Any], run_dir: Path, training: TrainingConfig,
                     step: int) -> str:
    """What a resume at ``step`` does to the learning rate when the schedule's settings differ
    from those the checkpoint trained under ("" when they do not, or cannot be known).

    The learning rate is a function of the step and these settings, so the resumed run follows
    the new schedule as if it had been planned from the start; the note gives the jump.
    """
    old = state.get("schedule")
    if not isinstance(old, dict):  # a checkpoint of an earlier version: the saved config's
        try:
            raw = read_yaml_file(run_dir / CONFIG_FILE, "run config")
            old = raw.get("training") if isinstance(raw, dict) else None
        except ConfigError:
            old = None
    if not isinstance(old, dict):
        return ""
    try:
        before = config_from_dict({"training": {key: old[key] for key in SCHEDULE_KEYS}})
    except (ConfigError, KeyError):
        return ""
    changed = [key for key in SCHEDULE_KEYS if getattr(before.training, key) !=
               getattr(training, key)]
    was = scheduled_learning_rate(before.training, step)
    now = scheduled_learning_rate(training, step)
    if not changed or was == now:
        return ""
    changes = ", ".join(f"training.{key} {getattr(before.training, key)!r} -> "
                        f"{getattr(training, key)!r}" for key in changed)
    note = (f"the learning-rate schedule is not the one the checkpoint trained under "
            f"({changes}): from step {step + 1} the learning rate follows the new one, "
            f"{now:.3g} where the old one gives {was:.3g}, as if the run had been planned "
            "this way from its start (the learning rate is a function of the step and these "
            "settings)")
    if step >= before.training.steps and before.training.schedule == "cosine":
        note += ("; the old schedule had ended, its learning rate decayed to 0, so the "
                 "weights move again and the loss may rise before it falls")
    return note


def read_tokenizer(run_dir: Path, action: str = "resume",
                   checkpoint: Optional[Dict[str, Any]] = None) -> CharTokenizer:
    """The run's saved tokenizer; RunError (`"cannot <action> ..."`) if missing or damaged, or
    if it is not the one ``checkpoint`` (the run's loaded checkpoint) was trained with."""
    from ..training.run_directory import check_tokenizer

    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise RunError(f"cannot {action} {run_dir}: {TOKENIZER_FILE} is missing")
    try:
        tokenizer = CharTokenizer.load(path)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise RunError(f"cannot {action} {run_dir}: {TOKENIZER_FILE} is damaged") from None
    if checkpoint is not None:
        check_tokenizer(run_dir, tokenizer.chars, checkpoint, action)
    return tokenizer


def check_reused_tokenizer(run_dir: Path, chars: Sequence[str]) -> None:
    """A finished run is reused only as intact as a resume would find it: its tokenizer holds
    ``chars``, those its text gives (an edited one would be refused by every later reader)."""
    if read_tokenizer(run_dir, "reuse").chars != list(chars):
        raise RunError(f"cannot reuse {run_dir}: {TOKENIZER_FILE} does not match its data "
                       "(the file was edited, or comes from another run); restore it, or "
                       "choose another --run-dir")


def _write_settings(run_dir: Path, config: Config, corpus: Corpus, task: Task) -> None:
    import json

    import yaml

    # The task (a causal LM's run has no task.json), then the config: a run killed before its
    # config is in place can only start afresh, one killed after it can be resumed (from step
    # 0 until a checkpoint exists; the vocabulary is the data's) and knows what it trains.
    if task.name != CAUSAL_LM:
        atomic_write(run_dir / TASK_FILE, json.dumps(task.settings()).encode())
    text = yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)
    atomic_write(run_dir / CONFIG_FILE, text.encode("utf-8"))
    tokenizer = {"kind": "char", "chars": corpus.tokenizer.chars}
    atomic_write(run_dir / TOKENIZER_FILE, json.dumps(tokenizer, ensure_ascii=False).encode())


def _remove(paths: Sequence[Path]) -> None:
    import shutil

    for path in paths:
        try:
            if path.name == TENSORBOARD_DIR and path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as error:
            raise RunError(f"cannot remove {path}: {error.strerror or error}") from None


# ------------------------------------------------------------------------------ a session


class _Session:
    """The model, optimizer, data streams and progress of one run, and its checkpoints."""

    def __init__(self, run: _Run) -> None:
        config, training = run.config, run.config.training
        self.run, self.config, self.training, self.task = run, config, training, run.task
        self.checkpoint_path = run.run_dir / CHECKPOINT_FILE
        torch.manual_seed(training.seed)
        self.model = self.task.build_model(config)
        self.optimizer = make_optimizer(self.model, config, run.backend)
        # The task draws the training batches from it: its state is the data position.
        self.batch_generator = torch.Generator().manual_seed(training.seed)
        # The same validation batches at every evaluation (and in `evaluate`).
        self.val_batches = self.task.validation_batches(run.corpus.val, config)
        self.step = 0
        self.val_curve: List[Tuple[int, float]] = []
        # The task's other validation metrics at the last evaluation.
        self.val_metrics: Dict[str, float] = {}
        self.last_train: Optional[float] = None
        self.train_seconds = 0.0
        self.trained_tokens = 0
        self.last_checkpoint: Optional[Path] = None
        self.saved_step: Optional[int] = None
        self.seconds = 0.0
        self.elapsed_before = 0.0  # wall-clock seconds of the run before this process
        vocab = run.corpus.tokenizer.vocab_size
        self.unigram = unigram_cross_entropy(run.corpus.train, run.corpus.val, vocab)
        self.loss_bound = divergence_bound(vocab)
        if run.state is not None:
            self._restore(run.state)
            # (once its weights are known to fit: a checkpoint of another model is said to be)
            check_checkpoint_logged(run.run_dir, run.state, "resume")
            _rewrite_for_resume(run, self.step)
        elif run.weights is not None:
            try:
                self.model.load_state_dict(run.weights)
            except RuntimeError as error:
                raise RunError(f"cannot fine-tune from {run.init_from}: its {CHECKPOINT_FILE} "
                               f"does not fit its {CONFIG_FILE}: {state_mismatch(error)}") from None
            check_checkpoint_logged(Path(str(run.init_from)), run.init_checkpoint,
                                    "fine-tune from")
        self.wrapper = build_training_model(self.model, self.optimizer, config, run.backend)
        # Until the first call, the host holds the only weights (PopTorch refuses to copy
        # from a model it has not compiled yet).
        self.weights_on_device = False
        # Of a distributed run, rank 0 alone writes the run's files.
        self.writes = writes_run_files()
        self.metrics = MetricsLog(run.run_dir / METRICS_FILE, fresh=run.state is None,
                                  fields=METRIC_FIELDS + self.task.metric_columns) \
            if self.writes else UnwrittenMetricsLog()
        self.tensorboard = TensorBoardLog(run.run_dir if self.writes else None, self.step)
        if self.tensorboard.problem:
            run.notes.append(self.tensorboard.problem)
        # Elapsed time counts on from the checkpoint's: a resumed run's figures are the run's.
        self.started = time.perf_counter() - self.elapsed_before

    def _restore(self, state: Dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
            self.batch_generator.set_state(state["batch_rng"])
            self.step = int(state["step"])
            self.val_curve = [(int(s), float(v)) for s, v in state.get("val_curve", [])]
            self.val_metrics = {str(k): float(v) for k, v in state.get("val_metrics", {}).items()}
            last = state.get("last_train_loss")
            self.last_train = None if last is None else float(last)
            self.train_seconds = float(state.get("train_seconds", 0.0))
            self.trained_tokens = int(state.get("trained_tokens", 0))
            # (a checkpoint of an earlier version: its training time, the best it knows)
            self.elapsed_before = float(state.get("elapsed_s", self.train_seconds))
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise RunError(f"checkpoint does not fit this config: {state_mismatch(error)}") \
                from None
        self.last_checkpoint = self.checkpoint_path
        self.saved_step = self.step

    def good_checkpoint(self) -> str:
        return str(self.last_checkpoint or "none")

    def train_call(self, inputs: Tensor, labels: Tensor) -> List[float]:
        """One call of the training model: ``device_iterations`` optimizer steps."""
        tick = time.perf_counter()
        try:
            _, losses = self.wrapper(inputs, labels)
            self.weights_on_device = True
        except NonFiniteAmaxError as error:
            raise TrainingDiverged(
                f"loss became nan at step {self.step + 1} (an FP8 cast met a non-finite "
                f"value); last good checkpoint: {self.good_checkpoint()}",
                self.step + 1, self.last_checkpoint,
            ) from error
        self.seconds = time.perf_counter() - tick
        self.train_seconds += self.seconds
        self.trained_tokens += inputs.numel()
        iterations = self.config.ipu.device_iterations
        return losses.detach().float().view(iterations, -1).mean(1).tolist()

    def _weights_to_host(self) -> None:
        if self.weights_on_device:
            self.wrapper.copy_weights_to_host()

    def evaluate(self) -> float:
        """The validation loss at this step, recorded in the validation curve (the task's
        other metrics in ``val_metrics``)."""
        metrics = self._validation_metrics()
        loss = metrics.pop("loss")
        self.val_curve.append((self.step, loss))
        self.val_metrics = metrics
        return loss

    def _validation_loss(self) -> float:
        return self._validation_metrics()["loss"]

    def _validation_metrics(self) -> Dict[str, float]:
        self._weights_to_host()
        model = self.model
        model.eval()
        try:
            with torch.no_grad():
                return self.task.evaluate(model, self.val_batches)
        finally:
            model.train()

    def _diverged(self, loss: float) -> bool:
        return not loss <= self.loss_bound  # NaN included

    def _divergence(self, what: str, loss: float, step: int) -> TrainingDiverged:
        if math.isfinite(loss):
            why = (f", more than {DIVERGENCE_MARGIN:g} nats above the uniform baseline ln V = "
                   f"{self.loss_bound - DIVERGENCE_MARGIN:.4f} (divergence)")
            shown = f"{loss:.6g}"
        else:
            why, shown = "", str(loss)
        return TrainingDiverged(
            f"{what} became {shown} at step {step}{why}; last good checkpoint: "
            f"{self.good_checkpoint()}", step, self.last_checkpoint,
        )

    @property
    def tokens_per_s(self) -> float:
        """Of the last call."""
        tokens = self.config.samples_per_call * self.config.model.seq_len
        return tokens / self.seconds if self.seconds else 0.0

    def log_step(self, lr: float, loss: float, val_loss: Optional[float]) -> None:
        """The step's row of metrics.csv (and its scalars for TensorBoard), with the task's
        other validation metrics on evaluation steps; raises TrainingDiverged past the
        divergence bound."""
        evaluated = self.val_metrics if val_loss is not None else {}
        self.metrics.write({
            "step": self.step, "lr": _exact(lr), "train_loss": _exact(loss),
            "val_loss": _exact(val_loss), "tokens_per_s": f"{self.tokens_per_s:.1f}",
            "elapsed_s": f"{self.elapsed:.3f}",
            **{f"val_{name}": _exact(value) for name, value in evaluated.items()},
        })
        self.tensorboard.log(self.step, {
            "train/loss": loss, "train/lr": lr, "train/tokens_per_s": self.tokens_per_s,
            "val/loss": val_loss, **{f"val/{name}": value for name, value in evaluated.items()},
        })
        if self._diverged(loss):
            raise self._divergence("loss", loss, self.step)
        self.last_train = loss
        if val_loss is not None and self._diverged(val_loss):
            raise self._divergence("validation loss", val_loss, self.step)

    @property
    def elapsed(self) -> float:
        """Wall-clock seconds of the run so far, over every process that trained it."""
        return time.perf_counter() - self.started

    def save(self, final: bool = False) -> None:
        """Checkpoint the current step, if its weights are good; rows logged so far are made
        durable first. Unless ``final`` (the caller writes the summary), ``summary.json``
        then records the run's progress and the checkpoint's step.

        Good means finite, with a validation loss within the divergence bound: the training
        loss of a step is that of the weights before its update, so only the validation loss
        (taken at this step anyway on evaluation steps) vouches for the weights saved.
        """
        self._weights_to_host()
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            raise TrainingDiverged(
                f"weights became non-finite at step {self.step}; last good checkpoint: "
                f"{self.good_checkpoint()}", self.step, self.last_checkpoint,
            )
        evaluated = self.val_curve and self.val_curve[-1][0] == self.step
        val_loss = self.val_curve[-1][1] if evaluated else self._validation_loss()
        if self._diverged(val_loss):
            raise self._divergence("validation loss of the weights to checkpoint",
                                   val_loss, self.step)
        self.metrics.sync()
        if self.writes:
            save_checkpoint(self.checkpoint_path, self._checkpoint(val_loss))
        self.last_checkpoint = self.checkpoint_path
        self.saved_step = self.step
        if not final and self.writes:
            write_summary(self.summary(
                "unfinished", f"checkpoint at step {self.step}; if its process is gone, "
                f"continue with: ipu-unit-scaling train --resume {self.run.run_dir}"))

    def _checkpoint(self, val_loss: float) -> Dict[str, Any]:
        from ..training.run_directory import tokenizer_sha256

        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "batch_rng": self.batch_generator.get_state(),
            "data_sha256": self.run.corpus.sha256,
            "val_curve": [list(p) for p in self.val_curve],
            "last_train_loss": self.last_train,
            "train_seconds": self.train_seconds,
            "trained_tokens": self.trained_tokens,
            "elapsed_s": self.elapsed,
            "schedule": _schedule_settings(self.training),
            "val_loss": val_loss,
            "base_chars": self.run.base_chars,
            "init_from": self.run.init_from,
            "tokenizer_sha256": tokenizer_sha256(self.run.corpus.tokenizer.chars),
            "task": self.task.settings(),
            "val_metrics": self.val_metrics,
        }

    def close(self) -> None:
        self.metrics.close()
        self.tensorboard.close()
        self.wrapper.destroy()

    def summary(self, status: str, message: str) -> RunSummary:
        run = self.run
        finite = [v for _, v in self.val_curve if math.isfinite(v)]
        unigram = self.unigram
        return RunSummary(
            run_dir=str(run.run_dir), status=status, steps=self.step,
            final_train_loss=self.last_train,
            final_val_loss=self.val_curve[-1][1] if self.val_curve else None,
            best_val_loss=min(finite) if finite else None,
            unigram_baseline=unigram, uniform_baseline=math.log(run.corpus.tokenizer.vocab_size),
            tokens_per_s=self.trained_tokens / self.train_seconds if self.train_seconds else 0.0,
            elapsed_s=self.elapsed, backend=run.backend,
            data=run.corpus.source, message=message, val_curve=self.val_curve,
            data_sha256=run.corpus.sha256, init_from=run.init_from,
            checkpoint_step=self.saved_step, task=self.task.name,
            model=model_kind(self.config), learning_rate=self.training.learning_rate,
            final_val_metrics=dict(self.val_metrics),
        )


def write_summary(summary: RunSummary) -> None:
    import json

    atomic_write(Path(summary.run_dir) / SUMMARY_FILE,
                 json.dumps(asdict(summary), indent=2).encode())


def _exact(value: Optional[float]) -> str:
    # repr round-trips exactly, so runs can be compared bit for bit from the CSV.
    return "" if value is None else repr(float(value))


# ------------------------------------------------------------------------------ the loop


def train(
    config: Optional[Config],
    run_dir: Path,
    *,
    resume: bool = False,
    overrides: Sequence[str] = (),
    quiet: bool = False,
    progress: Optional[bool] = None,
    scale_report: Optional[int] = None,
    desc: str = "train",
    log: Callable[[str], None] = print,
    init_from: Optional[Path] = None,
    task: Optional[Task] = None,
) -> RunSummary:
    """Train ``config`` into ``run_dir``, or with ``resume`` continue the run there (with
    ``config``, or None for the run's saved config with ``overrides`` applied).

    ``task`` is what to train (:mod:`.tasks`): the causal LM when None; a resumed run
    continues the task it trained (a ``task`` given must be that one).
    ``init_from`` fine-tunes: the new run starts from the checkpoint of the run in that
    directory, whose model ``config`` must keep (see :mod:`.finetune`).

    Raises TrainingDiverged on a non-finite loss or one past :func:`divergence_bound`,
    TrainingInterrupted on SIGINT (Ctrl-C) or SIGTERM (after saving a checkpoint at a step
    boundary), RunError, ConfigError or DataError for unusable inputs.
    """
    run_dir = Path(run_dir)
    if resume and init_from is not None:
        raise RunError("a resumed run keeps its own start; init_from is for new runs")
    if scale_report and launched_world_size() > 1:
        raise RunError("a scale report is recorded by one process; train without torchrun")
    # Under torchrun, rank 0 opens the run and hands it to the others (backends.distributed).
    join_launched_world()
    with opened_by_rank_zero(
            lambda: _opened(config, run_dir, resume, overrides, init_from, task)) as run:
        return _train(run, quiet or not writes_run_files(), progress, scale_report, desc, log)


@contextmanager
def _opened(config: Optional[Config], run_dir: Path, resume: bool, overrides: Sequence[str],
            init_from: Optional[Path], task: Optional[Task]) -> Iterator[_Run]:
    """The run in ``run_dir``, new or resumed, under its lock until the context ends."""
    if not resume:
        make_run_dir(run_dir)
    elif not_a_directory(run_dir):
        raise RunError(f"cannot resume {run_dir}: {not_a_directory(run_dir)}")
    with RunLock(run_dir):
        remove_temporaries(run_dir)
        if resume:
            trained = read_task(run_dir)
            if task is not None and task.settings() != trained.settings():
                raise RunError(f"cannot resume {run_dir}: it trains {trained.settings()}, not "
                               f"{task.settings()}")
            task = trained
        if task is None:
            task = CausalLM()
        if config is None:
            config = load_run_config(run_dir, overrides)
            if resume:  # its weights are those of the saved model, whatever --set says
                check_same_model(load_run_config(run_dir), config, str(run_dir), "a resume",
                                 ": its checkpoint does not fit another")
        backend = select_backend(config.backend, config)
        task.check(config, backend)
        if resume:
            yield _open_resumed(config, run_dir, backend, task)
        else:
            yield _open_new(config, run_dir, backend, task, init_from)


def _train(
    run: _Run, quiet: bool, progress: Optional[bool], scale_report: Optional[int], desc: str,
    log: Callable[[str], None],
) -> RunSummary:
    config, training, corpus = run.config, run.config.training, run.corpus
    session = _Session(run)
    reporter = None
    if scale_report:
        from ..analysis import ScaleReporter  # type: ignore[attr-defined]

        reporter = ScaleReporter(run.run_dir, scale_report)
    show_bar = (not quiet) and (progress if progress is not None else _stderr_is_tty())
    bar = _progress_bar(training.steps, session.step, show_bar, desc)
    say = bar.write if bar is not None else (lambda text: None) if quiet else log

    unigram = session.unigram
    if session.step == 0:
        say(f"{desc}: {corpus.source}, {len(corpus.train)} train / {len(corpus.val)} val "
            f"characters, vocabulary {corpus.tokenizer.vocab_size}; unigram baseline "
            f"{unigram:.4f} nats")
    else:
        say(f"{desc}: resuming {run.run_dir} at step {session.step} of {training.steps}")
    for note in run.notes:
        say(f"{desc}: {note}")
    if run.weights is not None and session.step == 0:
        # Fine-tuning: the loss it starts from, and a first checkpoint holding the start, so
        # that a resume after any kill still fine-tunes.
        say(f"{desc}: step 0 (the pretrained weights): validation loss "
            f"{session.evaluate():.4f} (unigram baseline {unigram:.4f})")
        session.save()
    if training.warmup_steps > training.steps:
        say(f"{desc}: training.warmup_steps ({training.warmup_steps}) is longer than the run; "
            f"warming up over all {warmup_steps(training)} steps")

    status, message = "completed", ""
    stop = _StopRequest()
    try:
        with stop:
            while session.step < training.steps:
                lr = scheduled_learning_rate(training, session.step)
                set_learning_rate(session.optimizer, lr)
                session.wrapper.update_optimizer()
                inputs, labels = run.task.train_batch(corpus.train, config,
                                                      session.batch_generator)
                losses = session.train_call(inputs, labels)

                first_step = session.step
                for index, loss in enumerate(losses):
                    session.step += 1
                    val_loss = None
                    if index == len(losses) - 1 and math.isfinite(loss) and (
                            session.step == training.steps
                            or _crossed(first_step, session.step, training.eval_interval)):
                        val_loss = session.evaluate()
                    session.log_step(lr, loss, val_loss)
                    if val_loss is not None:
                        others = "".join(f", {name} {value:.4f}"
                                         for name, value in session.val_metrics.items())
                        say(f"{desc}: step {session.step}: validation loss {val_loss:.4f}"
                            f"{others} (unigram baseline {unigram:.4f})")

                if reporter is not None:
                    micro = config.micro_batch_size
                    reporter.maybe_record(session.step, session.model, inputs[:micro],
                                          labels[:micro])
                rate = session.tokens_per_s
                if bar is not None:
                    bar.update(session.step - first_step)
                    bar.set_postfix(loss=f"{session.last_train:.4f}", tok_s=f"{rate:.0f}")
                elif not quiet and _crossed(first_step, session.step, training.log_interval):
                    log(f"{desc}: step {session.step}/{training.steps} loss "
                        f"{session.last_train:.4f} {rate:.0f} tokens/s")
                if session.step < training.steps and _crossed(
                        first_step, session.step, training.checkpoint_interval):
                    session.save()
                # Every rank stops at the step any of them was asked to stop at. A signal
                # that arrives during the agreement stays in stop.signum for the next one.
                agreed = agreed_stop(stop.signum)
                if agreed is not None:
                    stop.signum = agreed
                    if session.saved_step != session.step:
                        session.save(final=True)
                    status = "interrupted"
                    message = (f"{stop.name}: interrupted at step {session.step}; checkpoint: "
                               f"{session.good_checkpoint()}; continue with: ipu-unit-scaling "
                               f"train --resume {run.run_dir}")
                    break
            if status == "completed" and session.saved_step != session.step:
                session.save(final=True)
    except TrainingDiverged as error:
        _finish(session, "diverged", str(error), say)
        raise
    except KeyboardInterrupt as error:
        signum = getattr(error, "signum", stop.signum or signal.SIGINT)
        raise TrainingInterrupted(
            f"{signal.Signals(signum).name}: interrupted during step {session.step + 1}; "
            f"nothing saved after it; last checkpoint: {session.good_checkpoint()}",
            session.step, session.last_checkpoint, signum,
        ) from error
    finally:
        session.close()
        if bar is not None:
            bar.close()
    summary = _finish(session, status, message, say)
    if status == "interrupted":
        raise TrainingInterrupted(message, session.step, session.checkpoint_path,
                                  stop.signum or signal.SIGINT)
    return summary


def _crossed(before: int, after: int, interval: int) -> bool:
    """Whether the steps ``before`` < s <= ``after`` of one call include a multiple of
    ``interval`` (a call of several device iterations can step over it)."""
    return bool(interval) and after // interval > before // interval


def _finish(session: _Session, status: str, message: str, say: Callable[[str], None]) -> RunSummary:
    """Write summary.json and loss.png; a figure that cannot be drawn costs only a warning."""
    from ..training.plots import plot_run

    summary = session.summary(status, message)
    run_dir, config = session.run.run_dir, session.config
    if not session.writes:
        return summary
    write_summary(summary)
    model_name = {"unit": "unit-scaled", "u-mup": "u-μP"}.get(model_kind(config), "plain")
    title = f"{model_name} {session.task.model_name}, {config.precision.dtype}"
    try:
        plot_run(run_dir / METRICS_FILE, run_dir / PLOT_FILE, summary.unigram_baseline, title)
    except (ImportError, RuntimeError) as error:
        say(f"{PLOT_FILE} not written: {error}")
    return summary


# ------------------------------------------------------------------------------ signals

# What asks a run to stop: Ctrl-C, and what kill, timeout, container runtimes and job
# schedulers send.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StopRequest:
    """The first SIGINT or SIGTERM asks the loop to stop at the next step boundary (``signum``
    says which came); a second one raises StopSignal, a KeyboardInterrupt, at once."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    def __enter__(self) -> _StopRequest:
        # Handlers can only be set from the main thread; elsewhere the caller's stay.
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise StopSignal(signum)
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            # (None: a handler Python did not install, which it cannot put back either)
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous = {}


def raise_stop_signal(signum: int, frame: Any) -> None:
    """A signal handler that stops what runs at once, like Ctrl-C: for SIGTERM outside the
    training loop (which stops at a step boundary instead)."""
    raise StopSignal(signum)


def _progress_bar(total: int, initial: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    import shutil

    from tqdm import tqdm

    # A terminal that reports zero columns (some ptys) would get an empty bar; fall back to 100.
    width = shutil.get_terminal_size((100, 20)).columns
    return tqdm(total=total, initial=initial, desc=desc, unit="step", ncols=width)


def _stderr_is_tty() -> bool:
    import sys

    return sys.stderr.isatty()
