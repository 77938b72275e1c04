"""A trained run as a model: its checkpoint in any precision, evaluated or sampled.

Behind ``ipu-unit-scaling evaluate`` and ``sample``. The run directory is only read, under
a shared lock (a run writing it refuses them, and they refuse a run), and everything read is
checked to belong together: the tokenizer against the SHA-256 its checkpoint records, the
checkpoint's model against the config. Models
run through :func:`ipu_unit_scaling.backends.build_inference_model`: a
``poptorch.inferenceModel`` on IPUs, the traced graph on the emulator, the eager model on the
CPU, where evaluation is exactly the training loop's validation (the same windows, the same
:func:`~ipu_unit_scaling.training.inference.mean_loss`), so the run's own precision reproduces its
final
validation loss bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..backends import build_inference_model, select_backend
from ..fp8.stats import fp8_stats
from ..loop.run_opening import load_run_config, read_tokenizer
from ..training.data import CharTokenizer, DataError, load_corpus, out_of_memory, read_text_file
from ..training.inference import (
    PRECISIONS,
    Batch,
    RoleScaleStats,
    TextBatches,
    encode_known,
    generate,
    mean_loss,
    precision_config,
    precision_of,
    scale_stats_by_role,
    text_batches,
    validation_batches,
)
from ..training.precision import build_model, model_label
from ..training.run_config import Config
from ..training.run_directory import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    EVALUATION_FILES,
    LOCK_FILE,
    RunError,
    RunLock,
    atomic_write,
    not_a_directory,
    state_mismatch,
)
from ..training.run_records import (
    check_checkpoint_logged,
    check_recorded_settings,
    checkpoint_sha256,
    load_checkpoint,
)

__all__ = [
    "TrainedRun", "open_run", "EvaluationRow", "Evaluation", "evaluate_run",
    "format_evaluation", "write_evaluation", "check_prompt", "sample_run", "default_prompt",
]


@dataclass
class TrainedRun:
    """What a run directory holds for inference: its config, tokenizer and checkpoint."""

    run_dir: Path
    config: Config
    tokenizer: CharTokenizer
    checkpoint: Dict[str, Any]
    checkpoint_sha256: Optional[str] = None  # names the exact checkpoint results came from

    @property
    def step(self) -> int:
        return int(self.checkpoint["step"])

    @property
    def precision(self) -> str:
        """The precision the run trained in: a name in PRECISIONS, or fp8-<scaling> for the
        other FP8 recipes."""
        return precision_of(self.config)

    @property
    def precisions(self) -> List[str]:
        """The precisions it can be evaluated in: :data:`PRECISIONS`, and the FP8 recipe it
        trained in when that is another (fp8-mx, fp8-block, ...)."""
        own = [] if self.precision in PRECISIONS else [self.precision]
        return list(PRECISIONS) + own

    def model(self, precision: str) -> nn.Module:
        """The checkpoint's model with ``precision``'s casts."""
        model = build_model(precision_config(self.config, precision))
        state = self.checkpoint["model"]
        if isinstance(state, dict):
            # The delayed recipe's amax histories are state of its casts, not of the model:
            # another precision's model has none to load.
            own = model.state_dict()
            state = {key: value for key, value in state.items()
                     if key in own or not key.endswith("amax_history")}
        try:
            model.load_state_dict(state)
        except (RuntimeError, KeyError, TypeError, AttributeError) as error:
            raise RunError(f"{self.run_dir / CHECKPOINT_FILE} is not a checkpoint of this run: "
                           f"its model does not fit {CONFIG_FILE} ({state_mismatch(error)})"
                           ) from None
        model.eval()
        return model

    def validation_batches(self) -> List[Batch]:
        """The windows the training loop validated on (its data must be unchanged)."""
        config = self.config
        corpus = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len,
                             self.tokenizer)
        if self.checkpoint.get("data_sha256") not in (None, corpus.sha256):
            # The model and tokenizer fit (open_run checked): the text changed, or the
            # checkpoint was trained elsewhere on other text with the same characters.
            raise RunError(
                f"{self.run_dir / CHECKPOINT_FILE} was not trained on {corpus.source}, the data "
                f"its {CONFIG_FILE} names: it is not a checkpoint of this run, or that text "
                "has changed since; evaluate another text with --data FILE")
        return validation_batches(corpus.val, config)


def open_run(run_dir: Path, action: str = "evaluate") -> TrainedRun:
    """Read ``run_dir``'s config, tokenizer and checkpoint through the run directory's checked
    loaders, under a shared lock (so all three come from the same moment of the run); a
    RunError (`"cannot <action> ..."`) if any is missing, damaged or not of the same run, or if a
    run is writing the directory. Hold ``RunLock(run_dir, shared=True)`` around the whole use
    to keep a run from starting meanwhile."""
    run_dir = Path(run_dir)
    problem = not_a_directory(run_dir)
    if problem:
        raise RunError(f"cannot {action} {run_dir}: {problem}")
    with RunLock(run_dir, shared=True, action=action):
        if not (run_dir / CHECKPOINT_FILE).is_file():
            raise RunError(f"cannot {action} {run_dir}: it holds no {CHECKPOINT_FILE} (not a "
                           "trained run, or one stopped before its first checkpoint)")
        config = load_run_config(run_dir, (), action)
        checkpoint = load_checkpoint(run_dir / CHECKPOINT_FILE)
        digest = checkpoint_sha256(run_dir / CHECKPOINT_FILE)
        tokenizer = read_tokenizer(run_dir, action, checkpoint)
    step = checkpoint["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RunError(f"cannot {action} {run_dir}: its {CHECKPOINT_FILE} is damaged (step "
                       f"{step!r})")
    if tokenizer.vocab_size != config.model.vocab_size:
        raise RunError(f"cannot {action} {run_dir}: its tokenizer has {tokenizer.vocab_size} "
                       f"characters but its model {config.model.vocab_size}")
    run = TrainedRun(run_dir, config, tokenizer, checkpoint, digest)
    run.model(run.precision)  # a checkpoint of another model is refused now, not mid-way
    # (one of this model's shapes, but trained with other settings than config.yaml's)
    check_recorded_settings(run_dir, config, checkpoint, action)
    check_checkpoint_logged(run_dir, checkpoint, action)  # one of another run of this model
    return run


def _destroy(runner: Any) -> None:
    runner.destroy()  # frees the IPU; a no-op for the host runners


def _inference_config(config: Config) -> Config:
    # One batch per call: a sampled window or an evaluation batch is one call's input, whatever
    # device_iterations training used (PopTorch splits a call's rows over device iterations).
    # A pipelined split is then compiled as ShardedExecution (backends/ipu/options.py): under
    # PipelinedExecution PopTorch needs device_iterations >= the number of pipeline stages.
    return dataclasses.replace(config, ipu=dataclasses.replace(config.ipu, device_iterations=1))


# ------------------------------------------------------------------------------ evaluation


@dataclass
class EvaluationRow:
    precision: str
    loss: float
    gap_to_fp32: Optional[float]  # nats
    gap_to_fp32_percent: Optional[float]
    scale_report: List[RoleScaleStats] = field(default_factory=list)


@dataclass
class Evaluation:
    run_dir: str
    step: int
    model: str  # "unit-scaled GPT", "plain GPT", "u-μP GPT" or a given model's factory
    trained_precision: str
    data: str
    tokens: int
    backend: str
    rows: List[EvaluationRow]
    checkpoint_sha256: Optional[str] = None  # of the checkpoint.pt at ``step`` it evaluated


def evaluate_run(
    run: TrainedRun,
    precisions: Optional[Sequence[str]] = None,
    data: Optional[str] = None,
    *,
    backend: Optional[str] = None,
    scale_report: bool = False,
    on_batch: Optional[Callable[[], None]] = None,
    on_start: Optional[Callable[[str, int], None]] = None,
) -> Evaluation:
    """The checkpoint's loss under each of ``precisions`` (default: all of ``run.precisions``),
    on the run's validation windows or on the text file ``data`` (encoded with the run's
    tokenizer, every character predicted).

    With ``scale_report``, FP8 precisions also report their casts' under- and overflow by role
    (counted on the host, where casts can be inspected). ``on_start`` receives the data's
    description and the number of ``on_batch`` calls to come, once the data is ready.
    """
    config = run.config
    precisions = list(run.precisions if precisions is None else precisions)
    backend = backend or select_backend(config.backend, training=False)
    batches: Sequence[Batch]
    if data is None:
        batches = run.validation_batches()
        tokens = sum(labels.numel() for _, labels in batches)
        description = (f"validation split: the {len(batches)} batches of "
                       f"{config.training.batch_size} x {config.model.seq_len} characters "
                       "the training run validated on")
    else:
        batches = _text_file_batches(run, data)
        tokens = batches.tokens
        description = f"{data}: {len(batches.ids)} characters"
    if on_start is not None:
        on_start(description, len(batches) * len(precisions))
    rows: List[EvaluationRow] = []
    for precision in precisions:
        model = run.model(precision)
        inference_config = _inference_config(precision_config(config, precision))
        runner = build_inference_model(model, inference_config, backend)
        try:
            if scale_report and precision.startswith("fp8"):
                host = runner if backend == "cpu" else build_inference_model(
                    model, inference_config, "cpu")
                with fp8_stats() as stats:
                    loss = mean_loss(host, batches, on_batch if host is runner else None)
                if host is not runner:
                    loss = mean_loss(runner, batches, on_batch)
                roles = scale_stats_by_role(stats.records)
            else:
                loss, roles = mean_loss(runner, batches, on_batch), []
        finally:
            _destroy(runner)
        rows.append(EvaluationRow(precision, loss, None, None, roles))
    reference = next((row.loss for row in rows if row.precision == "fp32"), None)
    if reference is not None and math.isfinite(reference):
        for row in rows:
            row.gap_to_fp32 = row.loss - reference
            row.gap_to_fp32_percent = 100.0 * (row.loss - reference) / reference
    return Evaluation(
        run_dir=str(run.run_dir), step=run.step,
        model=model_label(config.model),
        trained_precision=run.precision, data=description, tokens=tokens, backend=backend,
        rows=rows, checkpoint_sha256=run.checkpoint_sha256,
    )


def _text_file_batches(run: TrainedRun, data: str) -> TextBatches:
    """The text file ``data`` in windows, held once as 32-bit ids; reading it is refused
    beforehand when it cannot fit in memory (as ``train`` refuses it)."""
    text = read_text_file(data)
    try:
        ids = encode_known(run.tokenizer, text, f"data file {data!r}", dtype=torch.int32)
    except (MemoryError, RuntimeError) as error:
        if not out_of_memory(error):
            raise
        raise DataError(f"data file {data!r} ({len(text)} characters) does not fit in the "
                        "free memory of this machine once encoded; free memory or use a "
                        "smaller file") from None
    del text
    return text_batches(ids, run.config.model.seq_len, run.config.training.batch_size)


def _loss_text(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def format_evaluation(evaluation: Evaluation) -> str:
    """Markdown: one row per precision (loss, gap to fp32), then the scale report if any."""
    digest = (f", sha256 {evaluation.checkpoint_sha256[:12]}"
              if evaluation.checkpoint_sha256 else "")
    lines = [
        f"Checkpoint {evaluation.run_dir} (step {evaluation.step}{digest}, {evaluation.model} "
        f"trained in {evaluation.trained_precision}); {evaluation.data}; "
        f"{evaluation.tokens} predicted characters; backend {evaluation.backend}.",
        "",
        "| precision | loss (nats/char) | gap to fp32 |",
        "|---|---|---|",
    ]
    for row in evaluation.rows:
        name = row.precision + (" (trained)" if row.precision == evaluation.trained_precision
                                else "")
        if row.gap_to_fp32 is None or row.gap_to_fp32_percent is None:
            gap = "-"
        elif row.precision == "fp32":
            gap = "reference"
        else:
            gap = f"{row.gap_to_fp32:+.4f} ({row.gap_to_fp32_percent:+.2f}%)"
        lines.append(f"| {name} | {_loss_text(row.loss)} | {gap} |")
    scaled = [row for row in evaluation.rows if row.scale_report]
    if scaled:
        lines += [
            "",
            "FP8 casts by role: underflow is the fraction of nonzero values flushed to zero, "
            "overflow the fraction beyond the format's max (saturated).",
            "",
            "| precision | role | casts | values | underflow | overflow |",
            "|---|---|---|---|---|---|",
        ]
        for row in scaled:
            for stats in row.scale_report:
                lines.append(f"| {row.precision} | {stats.role} | {stats.casts} | "
                             f"{stats.values} | {100 * stats.underflow:.3f}% | "
                             f"{100 * stats.overflow:.3f}% |")
    return "\n".join(lines)


def write_evaluation(evaluation: Evaluation, directory: Path) -> List[Path]:
    """``evaluate.md`` and ``evaluate.json`` in ``directory``; returns their paths. A run
    directory another run is writing is refused (RunError), as ``evaluate`` refuses to read
    one: the directory is locked, shared, while the results are written (a directory no run
    ever locked has no lock file, and gets none)."""
    import contextlib

    markdown, data = (Path(directory) / name for name in EVALUATION_FILES)
    locked = os.path.lexists(Path(directory) / LOCK_FILE)
    with RunLock(directory, shared=True, action="write the evaluation into") if locked \
            else contextlib.nullcontext():
        atomic_write(markdown, (format_evaluation(evaluation) + "\n").encode("utf-8"))
        atomic_write(data, (json.dumps(asdict(evaluation), indent=2) + "\n").encode("utf-8"))
    return [markdown, data]


# ---------------------------------------------------------------------------------- sampling


def default_prompt(tokenizer: CharTokenizer) -> str:
    """A newline where the run knows one (text starts as a new paragraph), else its first
    character."""
    return "\n" if "\n" in tokenizer.chars else tokenizer.chars[0]


def check_prompt(tokenizer: CharTokenizer, prompt: str) -> List[int]:
    """The prompt's ids; a DataError if it is empty or holds characters the tokenizer lacks."""
    if not prompt:
        raise DataError("the prompt is empty; leave --prompt out to start a new paragraph")
    return encode_known(tokenizer, prompt, "the prompt").tolist()


def sample_run(
    run: TrainedRun,
    prompt: Optional[str] = None,
    tokens: int = 200,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    seed: int = 0,
    precision: Optional[str] = None,
    backend: Optional[str] = None,
    on_text: Optional[Callable[[str], None]] = None,
) -> str:
    """``tokens`` characters the checkpoint writes after ``prompt`` (default
    :func:`default_prompt`), in ``precision`` (default: the one it trained in).

    ``on_text`` receives each character as it is drawn. Deterministic for a seed.
    """
    ids = check_prompt(run.tokenizer, default_prompt(run.tokenizer) if prompt is None else prompt)
    precision = precision or run.precision
    config = _inference_config(precision_config(run.config, precision))
    backend = backend or select_backend(config.backend, training=False)
    runner = build_inference_model(run.model(precision), config, backend)
    chars = run.tokenizer.chars
    emit = (lambda token: on_text(chars[token])) if on_text is not None else None
    try:
        drawn = generate(
            runner, ids, tokens, config.model.seq_len, temperature=temperature, top_k=top_k,
            seed=seed, rows=runner.rows_per_call,
            on_token=emit,
        )
    finally:
        _destroy(runner)
    return run.tokenizer.decode(drawn)
