"""One training session of the loop: the model, optimizer, batches, metrics and checkpoints of
an opened run, advanced step by step by :func:`.training_loop.train`.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..backends import build_training_model, capabilities, make_optimizer
from ..backends.distributed import (
    done_by_rank_zero,
    failure_of_another_rank,
    writes_run_files,
)
from ..fp8 import NonFiniteAmaxError
from ..training.data import unigram_cross_entropy
from ..training.precision import (
    model_kind,
)
from ..training.run_directory import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRIC_FIELDS,
    METRICS_FILE,
    TELEMETRY_FILE,
    RunError,
    state_mismatch,
)
from ..training.run_records import (
    MetricsLog,
    UnwrittenMetricsLog,
    recorded_settings,
    save_checkpoint,
)
from ..training.telemetry import Telemetry, sampled
from ..training.tensorboard_log import TensorBoardLog
from .run_opening import OpenedRun, check_start, rewrite_for_resume, schedule_settings
from .run_outcomes import (
    DIVERGENCE_MARGIN,
    RunSummary,
    TrainingDiverged,
    divergence_bound,
    exact_repr,
    write_summary,
)

# ------------------------------------------------------------------------------ a session

# The buffer the delayed FP8 recipe keeps its past amaxes in (ipu_unit_scaling.fp8.linear).
RECIPE_STATE_SUFFIX = "amax_history"


def recipe_state_for(own: Dict[str, Any], weights: Dict[str, Any]) -> Dict[str, Any]:
    """``weights`` for a fine-tuning model whose own state is ``own``: the FP8 recipe's amax
    histories are state of the casts, not weights, so those the model lacks (another recipe)
    are dropped, and those it has that ``weights`` lack or shape otherwise (another recipe or
    history length) start fresh, as the model built them. Every other key is left to the
    strict load."""
    fitted = {key: value for key, value in weights.items()
              if not key.endswith(RECIPE_STATE_SUFFIX) or key in own}
    for key, value in own.items():
        if key.endswith(RECIPE_STATE_SUFFIX):
            given = fitted.get(key)
            if not isinstance(given, Tensor) or given.shape != value.shape:
                fitted[key] = value
    return fitted



def _caused_by(error: BaseException, kind: type) -> bool:
    """Whether ``error`` or an exception it was raised from or during is a ``kind``."""
    seen = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class TrainingSession:
    """The model, optimizer, data streams and progress of one run, and its checkpoints."""

    def __init__(self, run: OpenedRun) -> None:
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
        # Whether this process trains a step: a resume at training.steps trains none, and
        # then rewrites nothing of the run's record.
        self.trains = run.state is None or int(run.state.get("step", 0)) < training.steps
        # Of a distributed run, rank 0 alone reads and writes the run directory (the other
        # ranks raise what stopped it).
        if run.state is not None:
            self._restore(run.state)
            # (once its weights are known to fit: a checkpoint of another model is said to be)
            done_by_rank_zero(lambda: self._rewrite_for_resume(run))
        elif run.weights is not None:
            try:
                self.model.load_state_dict(
                    recipe_state_for(self.model.state_dict(), run.weights))
            except RuntimeError as error:
                raise RunError(f"cannot fine-tune from {run.init_from}: its {CHECKPOINT_FILE} "
                               f"does not fit its {CONFIG_FILE}: {state_mismatch(error)}") from None
            done_by_rank_zero(lambda: check_start(run))
        self.wrapper = build_training_model(self.model, self.optimizer, config, run.backend)
        # Until the first call, the host holds the only weights (PopTorch refuses to copy
        # from a model it has not compiled yet).
        self.weights_on_device = False
        # Of a distributed run, rank 0 alone writes the run's files.
        self.writes = writes_run_files()
        self.metrics = MetricsLog(run.run_dir / METRICS_FILE, fresh=run.state is None,
                                  fields=METRIC_FIELDS + self.task.metric_columns) \
            if self.writes else UnwrittenMetricsLog()
        self.tensorboard = TensorBoardLog(run.run_dir if self.writes and self.trains else None,
                                          self.step)
        if self.tensorboard.note:  # where its scalars go, or why they are not written
            run.notes.append(self.tensorboard.note)
        # A backend that traces the model (PopTorch, PopXL) runs no hook: its sampled steps
        # are replayed on the host (Telemetry.replay).
        self.traces_the_model = capabilities(run.backend, config.ipu).traces_the_model
        self.telemetry = self._open_telemetry(run)
        # Elapsed time counts on from the checkpoint's: a resumed run's figures are the run's.
        self.started = time.perf_counter() - self.elapsed_before

    def _open_telemetry(self, run: OpenedRun) -> Optional[Telemetry]:
        section = self.config.telemetry
        if not section.interval:
            return None
        telemetry = Telemetry(
            self.model, self.optimizer,
            run.run_dir / TELEMETRY_FILE if self.writes and self.trains else None,
            config=section, fp8=self.config.precision.fp8, log=None,
            fresh=run.state is None, on_rows=self._telemetry_to_tensorboard)
        if run.state is not None and isinstance(run.state.get("telemetry"), dict):
            telemetry.monitor.load_state_dict(run.state["telemetry"])
        return telemetry

    def _telemetry_to_tensorboard(self, rows: List[Dict[str, Any]]) -> None:
        scalars: Dict[str, Optional[float]] = {}
        biases, ratios = [], []
        for row in rows:
            site, kind = row["site"], row["kind"]
            if kind == "cast":
                for name in ("flushed_fraction", "saturated_fraction", "log2_scale", "sqnr_db"):
                    scalars[f"telemetry/{site}/{name}"] = float(row[name])
                biases.append(float(row["log2_scale"]))
            elif kind == "param" and row["update_ratio"] and row["update_ratio"] > 0:
                scalars[f"telemetry/{site}/update_ratio"] = row["update_ratio"]
                ratios.append(math.log10(row["update_ratio"]))
            elif kind == "attention":
                scalars[f"telemetry/{site}/largest_logit"] = row["amax"]
        if rows:
            step = rows[0]["step"]
            self.tensorboard.log(step, {k: v for k, v in scalars.items()
                                        if v is not None and math.isfinite(v)})
            self.tensorboard.histogram(step, "telemetry/scaling_bias", biases)
            self.tensorboard.histogram(step, "telemetry/log10_update_ratio", ratios)

    def _rewrite_for_resume(self, run: OpenedRun) -> None:
        check_start(run)
        if self.trains:
            rewrite_for_resume(run, self.step)

    def _restore(self, state: Dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(state["model"])
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise RunError(f"checkpoint does not fit this config: {state_mismatch(error)}") \
                from None
        try:
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
            # (weights that fit, of a model with other parameter groups: say which setting)
            raise RunError(self.run.settings_problem or "checkpoint does not fit this config: "
                           f"{state_mismatch(error)}") from None
        self.last_checkpoint = self.checkpoint_path
        self.saved_step = self.step

    def good_checkpoint(self) -> str:
        return str(self.last_checkpoint or "none")

    def train_call(self, inputs: Tensor, labels: Tensor) -> List[float]:
        """One call of the training model: ``device_iterations`` optimizer steps (recorded by
        the run's telemetry when it makes a sampled step)."""
        iterations = self.config.ipu.device_iterations
        telemetry = self.telemetry
        replay = telemetry is not None and self.traces_the_model and \
            sampled(telemetry.config.interval, self.step, self.step + iterations)
        before: Dict[str, Tensor] = {}
        if replay:
            self._weights_to_host()
            before = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        recording = telemetry.call(self.step, self.step + iterations) \
            if telemetry is not None and not self.traces_the_model else contextlib.nullcontext()
        tick = time.perf_counter()
        try:
            with recording:
                _, losses = self.wrapper(inputs, labels)
            self.weights_on_device = True
        except Exception as error:
            # (a pipeline stage's failure comes wrapped in the schedule's RuntimeError)
            if _caused_by(error, NonFiniteAmaxError):
                raise TrainingDiverged(
                    f"loss became nan at step {self.step + 1} (an FP8 cast met a non-finite "
                    f"value); last good checkpoint: {self.good_checkpoint()}",
                    self.step + 1, self.last_checkpoint,
                ) from error
            # Under torchrun, a stage on another rank that diverged leaves this one a broken
            # connection: rank 0 takes over its cause, and records the run as diverged.
            spans = capabilities(self.run.backend, self.config.ipu).spans_processes
            relayed = failure_of_another_rank() if spans else None
            if isinstance(relayed, TrainingDiverged):
                raise TrainingDiverged(str(relayed), relayed.step, self.last_checkpoint) \
                    from None
            raise
        self.seconds = time.perf_counter() - tick
        self.train_seconds += self.seconds
        self.trained_tokens += inputs.numel()
        if replay and telemetry is not None:
            self._weights_to_host()
            telemetry.replay(self.step + iterations, before, self._last_step_batches(
                inputs, labels), lambda x, y: self.model(x, y, return_logits=True)[0])
        return losses.detach().float().view(iterations, -1).mean(1).tolist()

    def _last_step_batches(self, inputs: Tensor, labels: Tensor) -> List[Tuple[Tensor, Tensor]]:
        """The micro-batches of the call's last optimizer step (PopTorch's batching rule)."""
        ipu = self.config.ipu
        per_step = ipu.gradient_accumulation * ipu.replication_factor
        chunks = list(zip(inputs.chunk(per_step * ipu.device_iterations),
                          labels.chunk(per_step * ipu.device_iterations)))
        return chunks[-per_step:]

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
            "step": self.step, "lr": exact_repr(lr), "train_loss": exact_repr(loss),
            "val_loss": exact_repr(val_loss), "tokens_per_s": f"{self.tokens_per_s:.1f}",
            "elapsed_s": f"{self.elapsed:.3f}",
            **{f"val_{name}": exact_repr(value) for name, value in evaluated.items()},
        })
        self.tensorboard.log(self.step, {
            "train/loss": loss, "train/lr": lr, "train/tokens_per_s": self.tokens_per_s,
            "val/loss": val_loss, **{f"val/{name}": value for name, value in evaluated.items()},
        })
        if self.telemetry is not None:
            self.telemetry.check_loss(self.step, loss)
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
        if self.telemetry is not None:
            self.telemetry.log.sync()
        if self.writes:
            save_checkpoint(self.checkpoint_path, self._checkpoint(val_loss))
        self.last_checkpoint = self.checkpoint_path
        self.saved_step = self.step
        if not final and self.writes:
            write_summary(self.summary(
                "unfinished", f"checkpoint at step {self.step}; if its process is gone, "
                f"continue with: ipu-unit-scaling train --resume {self.run.run_dir}"))

    def _checkpoint(self, val_loss: float) -> Dict[str, Any]:
        from ..training.run_records import tokenizer_sha256

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
            "schedule": schedule_settings(self.training),
            "val_loss": val_loss,
            "base_chars": self.run.base_chars,
            "init_from": self.run.init_from,
            "tokenizer_sha256": tokenizer_sha256(self.run.corpus.tokenizer.chars),
            "task": self.task.settings(),
            "val_metrics": self.val_metrics,
            # (what config.yaml must still say for every reader of the run)
            "settings": recorded_settings(self.config),
            # (so that a resumed run warns as the uninterrupted one would have)
            "telemetry": None if self.telemetry is None else
            self.telemetry.monitor.state_dict(),
        }

    def close(self) -> None:
        self.metrics.close()
        if self.telemetry is not None:
            self.telemetry.close()
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
            model=model_kind(self.config.model), learning_rate=self.training.learning_rate,
            final_val_metrics=dict(self.val_metrics),
        )
