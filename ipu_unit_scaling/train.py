"""The training loop behind ``ipu-unit-scaling train`` and ``compare``.

A run lives in one directory::

    config.yaml      the resolved config (the model's vocabulary is the corpus's)
    tokenizer.json   the character vocabulary, reused on resume
    metrics.csv      one row per optimizer step; validation loss on evaluation steps
    checkpoint.pt    model, optimizer, RNG states and step (written atomically)
    summary.json     final losses, baselines, throughput and how the run ended
    loss.png         training and validation loss against the unigram baseline

Runs are deterministic on CPU for a given seed and thread count: a run resumed from a
checkpoint produces bit for bit the losses of the uninterrupted run.
"""
from __future__ import annotations

import copy
import csv
import json
import math
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from . import functional as U
from .backends import build_training_model, make_optimizer, select_backend
from .config import (
    REGIMES,
    UMUP_MULTIPLIERS,
    Config,
    config_from_dict,
    scheduled_learning_rate,
    validate,
)
from .data import CharTokenizer, Corpus, DataError, get_batch, load_corpus, unigram_cross_entropy
from .fp8 import NonFiniteAmaxError
from .models import GPTConfig, build_gpt
from .optim import set_learning_rate

__all__ = [
    "RunError",
    "TrainingDiverged",
    "TrainingInterrupted",
    "RunSummary",
    "REGIME_SETTINGS",
    "regime_config",
    "MODEL_KINDS",
    "set_model_kind",
    "model_kind",
    "simulate_fp16",
    "build_model",
    "save_checkpoint",
    "load_checkpoint",
    "train",
    "read_metrics",
]

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.csv"
CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
METRIC_FIELDS = ("step", "lr", "train_loss", "val_loss", "tokens_per_s", "elapsed_s")

# regime -> (model: plain, unit or u-mup; precision dtype; FP8 scaling)
REGIME_SETTINGS: Dict[str, Tuple[str, str, str]] = {
    "fp32": ("plain", "fp32", "amax"),
    "fp16": ("plain", "fp16", "amax"),
    "fp8-naive": ("plain", "fp8", "static"),
    "fp8-amax": ("plain", "fp8", "amax"),
    "unit-fp32": ("unit", "fp32", "amax"),
    "unit-fp16": ("unit", "fp16", "amax"),
    "unit-fp8": ("unit", "fp8", "static"),
    "unit-fp8-amax": ("unit", "fp8", "amax"),
    "umup-fp32": ("u-mup", "fp32", "amax"),
    "umup-fp16": ("u-mup", "fp16", "amax"),
    "umup-fp8": ("u-mup", "fp8", "static"),
    "umup-fp8-amax": ("u-mup", "fp8", "amax"),
}
assert set(REGIME_SETTINGS) == set(REGIMES)
MODEL_KINDS = ("plain", "unit", "u-mup")


class RunError(ValueError):
    """A run that cannot start or resume as asked (bad run directory, mismatched data)."""


class TrainingDiverged(RuntimeError):
    """The loss (or the weights) became non-finite; nothing was saved after that."""

    def __init__(self, message: str, step: int, checkpoint: Optional[Path]):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class TrainingInterrupted(RuntimeError):
    """Ctrl-C: the run stopped at a step boundary (with a checkpoint) or mid-step (without)."""

    def __init__(self, message: str, step: int, checkpoint: Optional[Path]):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


# ---------------------------------------------------------------------------------- precision


def regime_config(config: Config, regime: str) -> Config:
    """``config`` set to one comparison regime: model build, precision and learning rate."""
    if regime not in REGIME_SETTINGS:
        raise ValueError(f"unknown regime {regime!r}; allowed: {', '.join(REGIMES)}")
    model, dtype, scaling = REGIME_SETTINGS[regime]
    result = copy.deepcopy(config)
    set_model_kind(result, model)
    result.precision.dtype = dtype
    result.precision.fp8.scaling = scaling
    result.training.learning_rate = config.compare.learning_rates[regime]
    return result


def set_model_kind(config: Config, kind: str) -> None:
    """Make ``config.model`` a plain, unit-scaled or u-μP GPT, in place. Each takes the model
    keys that apply to it: the others go back to their defaults (u-μP's multipliers outside
    u-μP, unit scaling's taus inside it), so the result always validates."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r} is not one of {', '.join(MODEL_KINDS)}")
    model, defaults = config.model, type(config.model)()
    model.unit_scaled = kind != "plain"
    model.parametrization = "u-mup" if kind == "u-mup" else "unit"
    reset = ("attn_tau", "mlp_tau") if kind == "u-mup" else UMUP_MULTIPLIERS
    for name in reset:
        setattr(model, name, getattr(defaults, name))


def model_kind(config: Config) -> str:
    """``plain``, ``unit`` or ``u-mup``: what :func:`set_model_kind` set."""
    if not config.model.unit_scaled:
        return "plain"
    return "u-mup" if config.model.parametrization == "u-mup" else "unit"


def round_to_half(x: Tensor) -> Tensor:
    """``x`` as float16 would hold it (overflow to inf, underflow to zero), gradient likewise.

    A round trip through float16: autograd of the two casts rounds the gradient the same way,
    so eager PyTorch and PopTorch's traced graph compute the same thing.
    """
    return x.to(torch.float16).to(x.dtype)


class FP16Linear(nn.Linear):
    """A linear layer whose matmul sees float16 operands and produces a float16 result.

    Input, weight and output are rounded to float16 in the forward pass; the output gradient
    and the input and weight gradients in the backward pass: the casts of an FP16 matmul with
    float32 accumulation, at the places FP8 casts go. A unit-scaled layer keeps its scales
    inside the rounding, as hardware that fuses them into the matmul would.
    """

    constraint: Optional[Any]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP16Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias  # type: ignore[assignment]
        new.constraint = getattr(linear, "constraint", None)
        return new

    def forward(self, input: Tensor) -> Tensor:
        weight = round_to_half(self.weight)
        bias = None if self.bias is None else round_to_half(self.bias)
        if self.constraint is None:
            output = F.linear(round_to_half(input), weight, bias)
        else:
            output = U.linear(round_to_half(input), weight, bias, self.constraint)
        return round_to_half(output)


def simulate_fp16(model: nn.Module) -> nn.Module:
    """Make every linear layer of ``model`` an :class:`FP16Linear`, in place (no loss scaling)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not isinstance(child, FP16Linear):
                setattr(parent, name, FP16Linear.from_linear(child))
    return model


def build_model(config: Config) -> nn.Module:
    """The example GPT that ``config.model`` describes, in ``config.precision``."""
    model: nn.Module = build_gpt(GPTConfig(**asdict(config.model)))
    if config.precision.dtype == "fp8":
        from .fp8 import FP8Config, simulate_fp8

        try:
            fp8_config = FP8Config(**asdict(config.precision.fp8))
        except ValueError as error:
            raise RunError(f"precision.fp8: {error}") from error
        model = simulate_fp8(model, fp8_config)
    elif config.precision.dtype == "fp16":
        model = simulate_fp16(model)
    return model


# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(path: Path, state: Dict[str, Any]) -> None:
    """Write ``state`` so that ``path`` always holds a whole checkpoint, old or new."""
    directory = path.parent
    handle, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, harmless to skip there.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise RunError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: say which, not how torch failed
        raise RunError(f"{path} is not a readable checkpoint ({type(error).__name__})") from error
    if not isinstance(state, dict) or "step" not in state or "model" not in state:
        raise RunError(f"{path} is not a checkpoint of this package")
    return state


# ---------------------------------------------------------------------------------- metrics


def read_metrics(run_dir: Path) -> List[Dict[str, str]]:
    """The rows of a run's metrics.csv, as strings."""
    with open(Path(run_dir) / METRICS_FILE, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _keep_metrics_up_to(path: Path, step: int) -> None:
    """Drop rows a killed run wrote after its last checkpoint, so a resume appends cleanly."""
    rows = [row for row in read_metrics(path.parent) if int(row["step"]) <= step]
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, METRIC_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(temporary, path)


def _format_float(value: Optional[float]) -> str:
    # repr round-trips exactly, so runs can be compared bit for bit from the CSV.
    return "" if value is None else repr(float(value))


@dataclass
class RunSummary:
    """What ``summary.json`` holds."""

    run_dir: str
    status: str  # completed, diverged or interrupted
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


# ------------------------------------------------------------------------------------ Ctrl-C


class _StopRequest:
    """The first Ctrl-C asks the loop to stop at the next step boundary; a second one
    raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


# ------------------------------------------------------------------------------ the loop


def _progress_bar(total: int, initial: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    import shutil

    from tqdm import tqdm

    # A terminal that reports zero columns (some ptys) would get an empty bar; fall back to 100.
    width = shutil.get_terminal_size((100, 20)).columns
    return tqdm(total=total, initial=initial, desc=desc, unit="step", ncols=width)


def _prepare_run_dir(run_dir: Path, resume: bool) -> None:
    if resume:
        if not (run_dir / CHECKPOINT_FILE).is_file():
            raise RunError(f"cannot resume {run_dir}: it holds no {CHECKPOINT_FILE}")
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"run directory {run_dir} is a file")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        raise RunError(
            f"run directory {run_dir} is not empty; continue it with --resume {run_dir} "
            "or choose another --run-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)


def load_run_config(run_dir: Path, overrides: List[str]) -> Config:
    """The resolved config saved in ``run_dir``, with ``section.key=value`` overrides."""
    from .config import _apply_override  # the same override syntax as load_config

    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RunError(f"cannot resume {run_dir}: it holds no {CONFIG_FILE}")
    with open(path, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle) or {}
    for override in overrides:
        _apply_override(raw, override)
    config = config_from_dict(raw)
    validate(config)
    return config


def _evaluate(model: nn.Module, batches: List[Tuple[Tensor, Tensor]]) -> float:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            losses = [float(model(inputs, labels)) for inputs, labels in batches]
    except NonFiniteAmaxError:  # FP8 casts refuse non-finite tensors: the loss is lost too
        losses = [math.nan]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def _all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def train(
    config: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    quiet: bool = False,
    progress: Optional[bool] = None,
    scale_report: Optional[int] = None,
    desc: str = "train",
    log: Callable[[str], None] = print,
) -> RunSummary:
    """Train ``config`` into ``run_dir`` (or continue the run there with ``resume``).

    Raises TrainingDiverged on a non-finite loss, TrainingInterrupted on Ctrl-C (after saving a
    checkpoint at a step boundary), RunError or DataError for unusable inputs.
    """
    run_dir = Path(run_dir)
    _prepare_run_dir(run_dir, resume)
    checkpoint_path = run_dir / CHECKPOINT_FILE
    state = load_checkpoint(checkpoint_path) if resume else None
    tokenizer = CharTokenizer.load(run_dir / TOKENIZER_FILE) if resume else None
    training, seq_len = config.training, config.model.seq_len
    corpus: Corpus = load_corpus(config.data.path, config.data.val_fraction, seq_len, tokenizer)
    if state is not None and state.get("data_sha256") != corpus.sha256:
        raise RunError(f"cannot resume {run_dir}: {corpus.source} is not the text it trained on")
    vocab = corpus.tokenizer.vocab_size
    if vocab > config.model.vocab_size:
        raise DataError(
            f"{corpus.source} has {vocab} distinct characters but model.vocab_size is "
            f"{config.model.vocab_size}; raise model.vocab_size"
        )
    config = copy.deepcopy(config)
    config.model.vocab_size = vocab  # the model predicts exactly the corpus's characters
    with open(run_dir / CONFIG_FILE, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config.to_dict(), handle, sort_keys=False)
    corpus.tokenizer.save(run_dir / TOKENIZER_FILE)

    backend = select_backend(config.backend)
    torch.manual_seed(training.seed)
    model = build_model(config)
    optimizer = make_optimizer(model, config, backend)
    batch_generator = torch.Generator().manual_seed(training.seed)
    # The same validation windows at every evaluation, drawn from their own generator.
    val_generator = torch.Generator().manual_seed(training.seed + 1)
    val_batches = [
        get_batch(corpus.val, training.batch_size, seq_len, val_generator)
        for _ in range(training.eval_batches)
    ]
    step = 0
    if state is not None:
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as error:
            first_line = str(error).strip().splitlines()[0]
            raise RunError(f"checkpoint does not fit this config: {first_line}") from error
        torch.set_rng_state(state["torch_rng"])
        batch_generator.set_state(state["batch_rng"])
        step = int(state["step"])
        _keep_metrics_up_to(run_dir / METRICS_FILE, step)
    wrapper = build_training_model(model, optimizer, config, backend)

    reporter = None
    if scale_report:
        from .analysis import ScaleReporter  # type: ignore[attr-defined]

        reporter = ScaleReporter(run_dir, scale_report)

    unigram = unigram_cross_entropy(corpus.train, corpus.val, vocab)
    uniform = math.log(vocab)
    steps_per_call = config.ipu.device_iterations
    tokens_per_call = config.samples_per_call * seq_len
    last_checkpoint: Optional[Path] = checkpoint_path if state is not None else None
    val_curve: List[Tuple[int, float]] = []
    if state is not None:
        val_curve = [(int(s), float(v)) for s, v in state.get("val_curve", [])]
    last_train: Optional[float] = None
    train_seconds = 0.0
    trained_tokens = 0
    started = time.perf_counter()
    status, message = "completed", ""

    def checkpoint() -> None:
        nonlocal last_checkpoint
        wrapper.copy_weights_to_host()
        if not _all_finite(model):
            raise TrainingDiverged(
                f"weights became non-finite at step {step}; last good checkpoint: "
                f"{last_checkpoint or 'none'}", step, last_checkpoint,
            )
        save_checkpoint(checkpoint_path, {
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "batch_rng": batch_generator.get_state(),
            "data_sha256": corpus.sha256,
            "val_curve": [list(p) for p in val_curve],
        })
        last_checkpoint = checkpoint_path

    show_bar = (not quiet) and (progress if progress is not None else _stderr_is_tty())
    bar = _progress_bar(training.steps, step, show_bar, desc)
    say = bar.write if bar is not None else (lambda text: None) if quiet else log
    if step == 0:
        say(f"{desc}: {corpus.source}, {len(corpus.train)} train / {len(corpus.val)} val "
            f"characters, vocabulary {vocab}; unigram baseline {unigram:.4f} nats")
    else:
        say(f"{desc}: resuming {run_dir} at step {step} of {training.steps}")
    metrics_path = run_dir / METRICS_FILE
    new_file = not metrics_path.exists()
    metrics_handle = open(metrics_path, "a", newline="", encoding="utf-8")
    writer = csv.DictWriter(metrics_handle, METRIC_FIELDS)
    if new_file:
        writer.writeheader()
    try:
        with _StopRequest() as stop:
            while step < training.steps:
                lr = scheduled_learning_rate(training, step)
                set_learning_rate(optimizer, lr)
                wrapper.update_optimizer()
                inputs, labels = get_batch(
                    corpus.train, config.samples_per_call, seq_len, batch_generator
                )
                tick = time.perf_counter()
                try:
                    _, losses = wrapper(inputs, labels)
                except NonFiniteAmaxError as error:
                    raise TrainingDiverged(
                        f"loss became nan at step {step + 1} (an FP8 cast met a non-finite "
                        f"value); last good checkpoint: {last_checkpoint or 'none'}",
                        step + 1, last_checkpoint,
                    ) from error
                seconds = time.perf_counter() - tick
                train_seconds += seconds
                trained_tokens += tokens_per_call
                step_losses = losses.detach().float().view(steps_per_call, -1).mean(1).tolist()
                first_step = step
                for offset, value in enumerate(step_losses):
                    step = first_step + offset + 1
                    val_loss = None
                    last_of_call = offset == len(step_losses) - 1
                    if math.isfinite(value) and last_of_call and (
                        step == training.steps
                        or (training.eval_interval and step % training.eval_interval == 0)
                    ):
                        wrapper.copy_weights_to_host()
                        val_loss = _evaluate(model, val_batches)
                        val_curve.append((step, val_loss))
                    writer.writerow({
                        "step": step, "lr": _format_float(lr),
                        "train_loss": _format_float(value),
                        "val_loss": _format_float(val_loss),
                        "tokens_per_s": f"{tokens_per_call / seconds:.1f}",
                        "elapsed_s": f"{time.perf_counter() - started:.3f}",
                    })
                    metrics_handle.flush()
                    if not math.isfinite(value):
                        raise TrainingDiverged(
                            f"loss became {value} at step {step}; last good checkpoint: "
                            f"{last_checkpoint or 'none'}", step, last_checkpoint,
                        )
                    last_train = value
                    if val_loss is not None and not math.isfinite(val_loss):
                        raise TrainingDiverged(
                            f"validation loss became {val_loss} at step {step}; last good "
                            f"checkpoint: {last_checkpoint or 'none'}", step, last_checkpoint,
                        )
                    if val_loss is not None:
                        say(f"{desc}: step {step}: validation loss {val_loss:.4f} "
                            f"(unigram baseline {unigram:.4f})")
                if reporter is not None:
                    reporter.maybe_record(step, model, inputs[: config.micro_batch_size],
                                          labels[: config.micro_batch_size])
                rate = tokens_per_call / seconds
                if bar is not None:
                    bar.update(step - first_step)
                    bar.set_postfix(loss=f"{last_train:.4f}", tok_s=f"{rate:.0f}")
                elif not quiet and step // training.log_interval > first_step // \
                        training.log_interval:
                    log(f"{desc}: step {step}/{training.steps} loss {last_train:.4f} "
                        f"{rate:.0f} tokens/s")
                if training.checkpoint_interval and \
                        step // training.checkpoint_interval > first_step // \
                        training.checkpoint_interval and step < training.steps:
                    checkpoint()
                if stop.requested:
                    checkpoint()
                    status = "interrupted"
                    message = (f"interrupted at step {step}; checkpoint: {checkpoint_path}; "
                               f"continue with: ipu-unit-scaling train --resume {run_dir}")
                    break
            if status == "completed":
                checkpoint()
    except TrainingDiverged as error:
        status, message = "diverged", str(error)
        _finish(run_dir, config, corpus, backend, status, message, step, last_train, val_curve,
                unigram, uniform, trained_tokens, train_seconds, started)
        raise
    except KeyboardInterrupt as error:
        message = (f"interrupted during step {step + 1}; nothing saved after it; last "
                   f"checkpoint: {last_checkpoint or 'none'}")
        raise TrainingInterrupted(message, step, last_checkpoint) from error
    finally:
        metrics_handle.close()
        if bar is not None:
            bar.close()
        wrapper.destroy()
    summary = _finish(run_dir, config, corpus, backend, status, message, step, last_train,
                      val_curve, unigram, uniform, trained_tokens, train_seconds, started)
    if status == "interrupted":
        raise TrainingInterrupted(message, step, checkpoint_path)
    return summary


def _stderr_is_tty() -> bool:
    import sys

    return sys.stderr.isatty()


def _finish(
    run_dir: Path, config: Config, corpus: Corpus, backend: str, status: str, message: str,
    step: int, last_train: Optional[float], val_curve: List[Tuple[int, float]],
    unigram: float, uniform: float, tokens: int, train_seconds: float, started: float,
) -> RunSummary:
    finite_vals = [v for _, v in val_curve if math.isfinite(v)]
    summary = RunSummary(
        run_dir=str(run_dir), status=status, steps=step, final_train_loss=last_train,
        final_val_loss=val_curve[-1][1] if val_curve else None,
        best_val_loss=min(finite_vals) if finite_vals else None,
        unigram_baseline=unigram, uniform_baseline=uniform,
        tokens_per_s=tokens / train_seconds if train_seconds else 0.0,
        elapsed_s=time.perf_counter() - started, backend=backend, data=corpus.source,
        message=message, val_curve=val_curve,
    )
    with open(run_dir / SUMMARY_FILE, "w", encoding="utf-8") as handle:
        json.dump(asdict(summary), handle, indent=2)
    from .plots import plot_run

    model_name = {"unit": "unit-scaled", "u-mup": "u-μP"}.get(model_kind(config), "plain")
    plot_run(run_dir / METRICS_FILE, run_dir / PLOT_FILE, unigram,
             title=f"{model_name} GPT, {config.precision.dtype}")
    return summary
