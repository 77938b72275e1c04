"""The training loop behind ``ipu-unit-scaling train``, ``compare`` and ``compare --model bert``.

One loop trains every task (:mod:`.tasks`: the causal-LM GPT, the masked-LM encoder) on every
backend (:mod:`ipu_unit_scaling.backends`): a task brings its model, batches and loss, a backend its
training model; the run directory, checkpoints, resume, locks, signals, evaluation, metrics and
figures are the loop's. A run lives in one directory (see
``ipu_unit_scaling.training.run_directory`` for how it is
written)::

    config.yaml      the resolved config (the model's vocabulary is the corpus's)
    tokenizer.json   the character vocabulary
    task.json        the task and its settings, for tasks other than the causal LM
    metrics.csv      one row per optimizer step; validation loss (and the task's other
                     validation metrics) on evaluation steps
    checkpoint.pt    model, optimizer, RNG states (the batch generator's is the data
                     position), step and progress, behind a checksum
    telemetry.csv    what the FP8 casts, parameters and attention did at sampled steps, and
                     the early warnings (see ipu_unit_scaling.training.telemetry)
    health.png       the telemetry as heat maps and scaling-bias tracks
    summary.json     final losses, baselines, throughput and how the run ended (while it
                     runs: its progress at its last checkpoint)
    loss.png         training and validation loss against the unigram baseline
    tensorboard/     the same scalars as TensorBoard event files, where TensorBoard is
                     installed (see :mod:`ipu_unit_scaling.training.tensorboard_log`)

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

import math
import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

from ..backends import select_backend
from ..backends.distributed import (
    agreed_stop,
    failure_of_another_rank,
    hand_failure_to_rank_zero,
    join_launched_world,
    launched_world_size,
    opened_by_rank_zero,
    writes_run_files,
)
from ..parametrization.mup_optimizers import set_learning_rate
from ..training.config_files import ConfigError
from ..training.finetune import check_same_model
from ..training.precision import model_label
from ..training.run_config import Config, scheduled_learning_rate, warmup_steps
from ..training.run_directory import (
    HEALTH_PLOT_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    TELEMETRY_FILE,
    RunError,
    RunLock,
    make_run_dir,
    not_a_directory,
    read_json,
    remove_temporaries,
)
from .run_opening import OpenedRun, load_run_config, open_new_run, open_resumed_run
from .run_outcomes import RunSummary, TrainingDiverged, TrainingInterrupted, write_summary
from .run_session import TrainingSession
from .stop_signals import StopRequest
from .tasks import CausalLM, Task, read_task

__all__ = ["train"]


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
    directory, whose model ``config`` must keep (see :mod:`ipu_unit_scaling.training.finetune`).

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
    try:
        with opened_by_rank_zero(
                lambda: _opened(config, run_dir, resume, overrides, init_from, task)) as run:
            return _train(run, quiet or not writes_run_files(), progress, scale_report, desc,
                          log)
    except BaseException as error:
        reported = _reported_by_rank_zero(error)
        if reported is error:
            raise
        raise reported from None


# What every rank of a distributed run meets alike, and says through rank 0 by itself.
def _told_alike() -> Tuple[type, ...]:
    from ..backends import BackendError
    from ..training.data import DataError

    return (RunError, ConfigError, DataError, BackendError, TrainingDiverged,
            TrainingInterrupted, KeyboardInterrupt)


def _reported_by_rank_zero(error: BaseException) -> BaseException:
    """Under torchrun, what a rank raises for ``error``: rank 0 says why the run stopped, once.

    A rank other than 0 hands its own failure to rank 0 and raises one the command does not
    print there (rank 0 prints what all meet alike). Rank 0, stopped by a failure that is not
    one all meet alike (a connection another rank closed), raises the other rank's instead.
    """
    if launched_world_size() <= 1 or isinstance(error, SystemExit):
        return error
    if not writes_run_files():
        hand_failure_to_rank_zero(error)
        if isinstance(error, _told_alike()):
            return error
        return RunError(f"stopped by {type(error).__name__}: {error}")
    if isinstance(error, _told_alike()):
        return error
    return failure_of_another_rank() or error


@contextmanager
def _opened(config: Optional[Config], run_dir: Path, resume: bool, overrides: Sequence[str],
            init_from: Optional[Path], task: Optional[Task]) -> Iterator[OpenedRun]:
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
            yield open_resumed_run(config, run_dir, backend, task)
        else:
            yield open_new_run(config, run_dir, backend, task, init_from)


def _train(
    run: OpenedRun, quiet: bool, progress: Optional[bool], scale_report: Optional[int], desc: str,
    log: Callable[[str], None],
) -> RunSummary:
    config, training, corpus = run.config, run.config.training, run.corpus
    session = TrainingSession(run)
    reporter = None
    if scale_report:
        from ..analysis import ScaleReporter  # type: ignore[attr-defined]

        reporter = ScaleReporter(run.run_dir, scale_report)
    show_bar = (not quiet) and (progress if progress is not None else _stderr_is_tty())
    bar = _progress_bar(training.steps, session.step, show_bar, desc)
    say = bar.write if bar is not None else (lambda text: None) if quiet else log

    if session.telemetry is not None:
        session.telemetry.say = say  # its early warnings, in the training log
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
    stop = StopRequest()
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


def _finish(session: TrainingSession, status: str, message: str,
            say: Callable[[str], None]) -> RunSummary:
    """Write summary.json and loss.png; a figure that cannot be drawn costs only a warning."""
    from ..training.plots import plot_run

    summary = session.summary(status, message)
    run_dir, config = session.run.run_dir, session.config
    recorded = _recorded_already(session, summary)
    if not session.writes:
        return summary
    if recorded is not None:
        summary = recorded
        if os.path.isfile(run_dir / PLOT_FILE) and (
                os.path.isfile(run_dir / HEALTH_PLOT_FILE) or
                not os.path.isfile(run_dir / TELEMETRY_FILE)):
            return summary
    else:
        write_summary(summary)
    title = f"{model_label(config.model, session.task.model_name)}, {config.precision.dtype}"
    try:
        plot_run(run_dir / METRICS_FILE, run_dir / PLOT_FILE, summary.unigram_baseline, title)
    except (ImportError, RuntimeError) as error:
        say(f"{PLOT_FILE} not written: {error}")
    _plot_health(run_dir, title, say)
    return summary


def _plot_health(run_dir: Path, title: str, say: Callable[[str], None]) -> None:
    """health.png from the run's telemetry, where it recorded any."""
    from ..training.health_plot import plot_health

    if not os.path.isfile(run_dir / TELEMETRY_FILE):
        return
    try:
        plot_health(run_dir / TELEMETRY_FILE, run_dir / HEALTH_PLOT_FILE, title)
    except (ImportError, RuntimeError, RunError) as error:
        say(f"{HEALTH_PLOT_FILE} not written: {error}")


def _recorded_already(session: TrainingSession, summary: RunSummary) -> Optional[RunSummary]:
    """The run's recorded summary where a resume that trained nothing finds its record
    complete: a summary of the run completed at its checkpoint's step (then it is not
    rewritten, nor the figure unless it is missing); else None."""
    import dataclasses

    if session.trains or summary.status != "completed" or not session.writes:
        return None
    recorded = read_json(session.run.run_dir / SUMMARY_FILE)
    if not recorded or recorded.get("status") != "completed" or \
            recorded.get("steps") != summary.steps or \
            recorded.get("checkpoint_step") != summary.checkpoint_step:
        return None
    names = {f.name for f in dataclasses.fields(RunSummary)}
    try:
        kept = RunSummary(**{k: v for k, v in recorded.items() if k in names})
    except TypeError:  # a summary missing fields: rewritten whole
        return None
    kept.val_curve = [tuple(point) for point in kept.val_curve]  # type: ignore[misc]
    return kept


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
