"""Opening a run directory for the loop: a new run, a resumed one or a fine-tuning one, with the
checks that a resume continues the same run (its config, tokenizer, checkpoint and schedule).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..backends import capabilities
from ..backends.registry import registered_names
from ..training.config_files import ConfigError, read_yaml_file
from ..training.data import CharTokenizer, Corpus, DataError, load_corpus
from ..training.finetune import check_same_model, encode_with, extend_model_state, extend_tokenizer
from ..training.memory import check_memory
from ..training.resume_policy import resume_refusal
from ..training.run_config import (
    Config,
    TrainingConfig,
    config_from_dict,
    earlier_run_settings,
    scheduled_learning_rate,
    validate,
)
from ..training.run_directory import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    INIT_FROM_FILE,
    METRIC_FIELDS,
    METRICS_FILE,
    SCALE_REPORT_FILE,
    SUMMARY_FILE,
    TASK_FILE,
    TELEMETRY_FILE,
    TENSORBOARD_DIR,
    TOKENIZER_FILE,
    RunError,
    atomic_write,
    leftovers,
    read_json,
)
from ..training.run_records import (
    check_checkpoint_logged,
    check_recorded_settings,
    keep_report_rows_up_to,
    load_checkpoint,
    metrics_up_to,
)
from .tasks import CAUSAL_LM, CausalLM, Task, read_task

# ------------------------------------------------------------------------ opening a run

def _host_activations(backend: str, config: Config) -> bool:
    """Whether the activations live in the host's memory (the IPU Model and the emulator
    simulate on the host; an IPU holds them in its own)."""
    return not capabilities(backend, config.ipu).activations_on_device


@dataclass
class OpenedRun:
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
    # Of a resume: why its checkpoint was not trained with its config.yaml ("" if it was), said
    # where the weights fit but the optimizer state does not.
    settings_problem: str = ""


def load_run_config(
    run_dir: Path, overrides: Sequence[str] = (), action: str = "resume"
) -> Config:
    """The resolved config saved in ``run_dir``, with ``section.key=value`` overrides.

    A missing, empty, damaged or incomplete ``config.yaml`` is a RunError naming it: a resume
    must never fall back to defaults for settings the run did not save. ``action`` says in the
    message what could not be done ("resume", "evaluate", ...).
    """
    from ..training.config_files import apply_override

    path = Path(run_dir) / CONFIG_FILE
    refuse = f"cannot {action} {run_dir}: {CONFIG_FILE}"
    problem = file_problem(path)
    if problem:
        raise RunError(f"{refuse} {problem}")
    try:
        raw = read_yaml_file(path, "run config")
        if raw is None:
            raise RunError(f"{refuse} is empty")
        if not isinstance(raw, dict):
            raise RunError(f"{refuse} is damaged (not a mapping)")
        earlier_run_settings(raw)
        missing = _missing_keys(raw, Config().to_dict())
        if missing:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise RunError(f"{refuse} is incomplete (no {shown})")
        validate(config_from_dict(raw))
    except ConfigError as error:
        problems = "; ".join(f"{p}: {m}" if p else m for p, m in error.errors)
        raise RunError(f"{refuse} is damaged: {' '.join(problems.split())}") from None
    known = ("auto",) + registered_names()
    if raw["backend"] not in known:  # (a config checks only the form of a backend's name)
        raise RunError(f"{refuse} names backend {raw['backend']!r}, which no backend is "
                       f"registered under (allowed: {', '.join(known)}): damaged, or a backend "
                       "this process did not register")
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


def file_problem(path: Path) -> str:
    """Why ``path`` cannot be read as a run's file ("is missing", "is a FIFO, not a regular
    file", ...), or "" when it is a regular file (after symbolic links). Nothing is opened:
    a FIFO or a device is never read."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return ("is a broken symbolic link" if os.path.islink(path) else "is missing")
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except ValueError:
        return "is not a usable path"
    if stat.S_ISREG(mode):
        return ""
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"is {kind}, not a regular file"
    return "is not a regular file"


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
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab))


def open_new_run(config: Config, run_dir: Path, backend: str, task: Task,
                 init_from: Optional[Path] = None) -> OpenedRun:
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
        run = OpenedRun(run_dir, resolved_config(config, corpus), corpus, backend, None, [],
                        task=task)
    else:
        if task.name != CAUSAL_LM:
            raise RunError(f"fine-tuning trains the causal LM, not a {task.name}")
        run = _fine_tuning(config, run_dir, backend, Path(init_from))
    run.notes.insert(0, check_memory(
        run.config, host_activations=_host_activations(backend, run.config)))
    if old:
        run.notes.append(f"{run_dir} held a run that never saved a checkpoint; starting afresh")
    _remove(old)
    _write_settings(run_dir, run.config, run.corpus, task, run.init_from)
    return run


def _fine_tuning(config: Config, run_dir: Path, backend: str, init_from: Path) -> OpenedRun:
    """A new run of ``config`` on its data, from the weights of the run in ``init_from``, with
    the rules of :mod:`ipu_unit_scaling.training.finetune` (the same model, the tokenizer
    extended)."""
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
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, vocab_size=tokenizer.vocab_size))
    if added:
        shown = "".join(added[:20]) + ("..." if len(added) > 20 else "")
        note = (f"{len(added)} new characters ({shown!r}) extend its {base.vocab_size}; their "
                "embedding and head rows start as the mean of the pretrained rows")
    else:
        note = f"its {base.vocab_size} characters cover the new text"
    return OpenedRun(
        run_dir, config, encode_with(text, tokenizer), backend, None,
        [f"fine-tuning {init_from} (step {int(state['step'])}): {note}"],
        weights=extend_model_state(state["model"], tokenizer.vocab_size),
        base_chars=list(base.chars), init_from=str(init_from),
        init_checkpoint={key: state.get(key) for key in ("step", "last_train_loss",
                                                         "settings")},
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


def open_resumed_run(config: Config, run_dir: Path, backend: str, task: Task) -> OpenedRun:
    """The run of ``task`` in ``run_dir`` at its checkpoint, every artefact checked before
    anything runs."""
    checkpoint_path = run_dir / CHECKPOINT_FILE
    if not checkpoint_path.exists():
        saved = _checkpoint_evidence(run_dir)
        if saved:
            raise RunError(f"cannot resume {run_dir}: {CHECKPOINT_FILE} is missing, but "
                           f"{saved}; nothing was changed: restore the checkpoint, or train "
                           "again in another --run-dir")
        # Stopped before its first checkpoint: nothing to continue, so from step 0 (a
        # fine-tuning run from its pretrained weights again).
        init_from = _recorded_start(run_dir)
        if init_from is not None:
            pretrained = load_run_config(Path(init_from), (), "fine-tune from")
            config = dataclasses.replace(config, model=dataclasses.replace(
                config.model, vocab_size=pretrained.model.vocab_size))
        run = open_new_run(config, run_dir, backend, task,
                           None if init_from is None else Path(init_from))
        restart = (f"{run_dir} has no checkpoint: the run never saved one; training from step 0 "
                   "with its saved config")
        # (a fine-tuning run keeps the note of what it fine-tunes; the rest is said above)
        run.notes[1:] = [restart] + (run.notes[1:2] if init_from is not None else [])
        return run
    problem = file_problem(checkpoint_path)
    if problem:
        raise RunError(f"cannot resume {run_dir}: {CHECKPOINT_FILE} {problem}")
    state = load_checkpoint(checkpoint_path)
    saved_config = load_run_config(run_dir)
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
    refusal = resume_refusal(saved_config.to_dict(), config.to_dict(), trains=step < steps)
    if refusal:
        raise RunError(f"cannot resume {run_dir}: {refusal}")
    iterations = config.ipu.device_iterations
    if (steps - step) % iterations:
        raise RunError(
            f"cannot resume {run_dir} at step {step}: the {steps - step} remaining steps are "
            f"not a multiple of ipu.device_iterations ({iterations})"
        )
    notes = [check_memory(config, host_activations=_host_activations(backend, config))]
    schedule_note = _schedule_change(state, run_dir, config.training, step)
    if schedule_note:
        notes.append(schedule_note)
    # The directory is rewritten (metrics cut back to the checkpoint, the settings of this
    # resume) only once the checkpoint has loaded into this config's model: a refused resume
    # changes nothing.
    try:
        check_recorded_settings(run_dir, saved_config, state, "resume")
        problem = ""
    except RunError as error:
        problem = str(error)
    return OpenedRun(run_dir, config, corpus, backend, state, notes, base_chars=list(base_chars),
                     init_from=state.get("init_from"), task=task, settings_problem=problem)


def _recorded_start(run_dir: Path) -> Optional[str]:
    """The run a fine-tuning run in ``run_dir`` started from (its INIT_FROM_FILE), or None."""
    path = run_dir / INIT_FROM_FILE
    if not path.exists() and not path.is_symlink():
        return None
    recorded = read_json(path)
    init_from = recorded.get("init_from") if recorded else None
    if not isinstance(init_from, str) or not init_from:
        raise RunError(f"cannot resume {run_dir}: {INIT_FROM_FILE} is damaged")
    return init_from


def check_start(run: OpenedRun) -> None:
    """Once the checkpoint's weights are known to fit the model (a checkpoint of another
    model is said to be, first): RunError unless the checkpoint a resumed or fine-tuning run
    starts from was trained with its run's config.yaml and is one its run saved."""
    if run.state is not None:
        check_recorded_settings(run.run_dir, load_run_config(run.run_dir), run.state, "resume")
        check_checkpoint_logged(run.run_dir, run.state, "resume")
    elif run.init_from is not None:
        action = "fine-tune from"
        source = Path(run.init_from)
        check_recorded_settings(source, load_run_config(source, (), action),
                                run.init_checkpoint, action)
        check_checkpoint_logged(source, run.init_checkpoint, action)


def rewrite_for_resume(run: OpenedRun, step: int) -> None:
    """The run's metrics, scale report and settings cut back to ``step``, its checkpoint."""
    atomic_write(run.run_dir / METRICS_FILE,
                 metrics_up_to(run.run_dir, step, METRIC_FIELDS + run.task.metric_columns))
    keep_report_rows_up_to(run.run_dir / SCALE_REPORT_FILE, step)
    keep_report_rows_up_to(run.run_dir / TELEMETRY_FILE, step)
    _write_settings(run.run_dir, run.config, run.corpus, run.task, run.init_from)


# The settings the learning rate of a step is a function of (with the step).
SCHEDULE_KEYS = ("steps", "warmup_steps", "learning_rate", "schedule")


def schedule_settings(training: TrainingConfig) -> Dict[str, Any]:
    """The training keys that shape the learning-rate schedule, with their values."""
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
    from ..training.run_records import check_tokenizer

    path = Path(run_dir) / TOKENIZER_FILE
    problem = file_problem(path)
    if problem:
        raise RunError(f"cannot {action} {run_dir}: {TOKENIZER_FILE} {problem}")
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


def _write_settings(run_dir: Path, config: Config, corpus: Corpus, task: Task,
                    init_from: Optional[str] = None) -> None:
    import json

    import yaml

    # The task (a causal LM's run has no task.json) and the start of a fine-tuning run, then
    # the config: a run killed before its config is in place can only start afresh, one
    # killed after it can be resumed (from step 0 until a checkpoint exists; the vocabulary is
    # the data's, or the extended one of the run it fine-tunes) and knows what it trains.
    if task.name != CAUSAL_LM:
        atomic_write(run_dir / TASK_FILE, json.dumps(task.settings()).encode())
    if init_from is not None:
        atomic_write(run_dir / INIT_FROM_FILE,
                     json.dumps({"init_from": init_from}, ensure_ascii=False).encode("utf-8"))
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
