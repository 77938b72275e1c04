"""Masked-language-model training of the BERT-style encoder, and the precision comparison
behind ``ipu-unit-scaling compare --model bert``: the unit-scaling paper's BERT experiment at a
size a CPU trains in minutes.

Data: the character corpus (see `data`), cut into sequences of random length between
`min_len` and `seq_len`, padded to `seq_len` with a padding token; BERT's masking picks 15% of
the real tokens as targets (at least one per sequence), of which 80% are replaced by a mask
token, 10% by a random character and 10% kept. The loss and the metrics count the targets
only: validation MLM loss (mean cross-entropy per target) and accuracy (targets predicted
exactly), on fixed validation batches.

Every run trains through the training loop of :mod:`ipu_unit_scaling.loop.training_loop` as
the task :class:`~ipu_unit_scaling.loop.tasks.MaskedLM`: a run is one regime and one seed, in its
own directory with the loop's files (config, checkpoint, metrics, summary, figure), checkpoints,
SIGINT/SIGTERM handling and resume. Every regime trains the same batches from the same seed. Running
the comparison again into the same directory reuses finished runs and resumes unfinished ones when
their settings are the same, and refuses, naming the settings, when they are not.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import reprlib
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..backends.registry import registered_names
from ..loop.masked_lm import (
    ENCODER_OPS,
    encoder_from_config,
)
from ..training.precision import REGIME_SETTINGS
from ..training.run_config import (
    MAX_TAU,
    Config,
    learning_rate_in_range,
    setting_differences,
)

__all__ = [
    "MLMConfig", "MLM_KEYS", "mlm_preset", "build_encoder", "run_config",
    "train_mlm", "run_mlm_compare", "format_mlm_table", "check_mlm_regimes", "encoder_kind",
    "MLM_REGIMES", "MLM_ALLOWED_REGIMES",
]

# The encoder's model kinds are ENCODER_OPS': plain and unit-scaled.
ENCODER_NAMES = {"plain": "plain", "unit": "unit-scaled"}
# Every regime of a kind the encoder has.
MLM_ALLOWED_REGIMES = tuple(regime for regime, (kind, _, _) in REGIME_SETTINGS.items()
                            if kind in ENCODER_OPS)
# The comparison the paper's BERT experiment makes (more regimes may be asked for).
MLM_REGIMES = ("fp32", "fp16", "fp8-naive", "unit-fp16", "unit-fp8")


def encoder_kind(regime: str) -> str:
    """``plain`` or ``unit``: the encoder a regime trains; ValueError for others."""
    check_mlm_regimes([regime])
    return REGIME_SETTINGS[regime][0]


def check_mlm_regimes(regimes: Sequence[str]) -> None:
    """ValueError naming the regimes the encoder cannot run (unknown ones, u-μP)."""
    unknown = [regime for regime in regimes if regime not in REGIME_SETTINGS]
    if unknown:
        guess = difflib.get_close_matches(unknown[0], MLM_ALLOWED_REGIMES, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise ValueError(f"{reprlib.repr(unknown[0])} is not a regime{hint} (--model bert's "
                         f"regimes: {', '.join(MLM_ALLOWED_REGIMES)})")
    refused = [regime for regime in regimes if regime not in MLM_ALLOWED_REGIMES]
    if refused:
        raise ValueError(f"--model bert cannot run {', '.join(refused)} (the BERT-style encoder "
                         f"is plain or unit-scaled, not u-μP); its regimes: "
                         f"{', '.join(MLM_ALLOWED_REGIMES)}")


# Each ``--set mlm.<key>`` and the key of the run config (configs/mlm.yaml) it sets; the
# masked LM's own settings, min_len and mask_prob, are fields of MLMConfig. In this order,
# compare.json lists the settings of a comparison.
MLM_KEYS = {
    "hidden_size": "model.hidden_size", "depth": "model.depth", "heads": "model.heads",
    "mlp_expansion": "model.mlp_expansion", "seq_len": "model.seq_len", "min_len": None,
    "mask_prob": None, "attn_tau": "model.attn_tau", "mlp_tau": "model.mlp_tau",
    "batch_size": "training.batch_size", "steps": "training.steps",
    "warmup_steps": "training.warmup_steps", "eval_interval": "training.eval_interval",
    "eval_batches": "training.eval_batches", "val_fraction": "data.val_fraction",
    "data": "data.path", "backend": "backend", "learning_rates": "compare.learning_rates",
}


def mlm_preset() -> Config:
    """The run config of the masked-LM comparison: ``configs/mlm.yaml``."""
    from ..training.run_config import load_config

    return load_config("mlm")


@dataclass(frozen=True)
class MLMConfig:
    """Shape, data and training of the masked-LM comparison (``--set mlm.<key>=value``).

    ``run`` is a run config (``configs/mlm.yaml``), and ``mlm.<key>`` one of its keys
    (:data:`MLM_KEYS`), read as an attribute (``config.steps`` is ``run.training.steps``;
    ``learning_rates`` holds the encoder's regimes of ``run.compare.learning_rates``). Each run
    trains with Adam on a cosine schedule after a linear warmup, and checkpoints at every
    evaluation (``eval_interval``) and at its end.
    """

    run: Config = field(default_factory=mlm_preset)
    min_len: int = 24
    mask_prob: float = 0.15

    def __getattr__(self, name: str) -> Any:
        """The value of the run config's key that ``mlm.<name>`` sets."""
        key = MLM_KEYS.get(name)
        if key is None or name.startswith("__"):
            raise AttributeError(name)
        node: Any = self.run
        for part in key.split("."):
            node = getattr(node, part)
        if name == "learning_rates":
            return {regime: node[regime] for regime in MLM_ALLOWED_REGIMES if regime in node}
        return node

    def settings(self) -> Dict[str, Any]:
        """Every ``mlm.<key>`` and its value, in the order of :data:`MLM_KEYS`."""
        return {name: getattr(self, name) for name in MLM_KEYS}

    def with_setting(self, name: str, value: Any) -> MLMConfig:
        """A copy with ``mlm.<name>`` set to ``value`` (unchecked: see :meth:`validate`)."""
        key = MLM_KEYS[name]
        if key is None:
            return dataclasses.replace(self, **{name: value})
        if name == "learning_rates":
            value = {**self.run.compare.learning_rates, **value}
        if name == "eval_interval":  # checkpoints reuse the evaluation that proves them good
            return self._with_key(key, value)._with_key("training.checkpoint_interval", value)
        return self._with_key(key, value)

    def _with_key(self, key: str, value: Any) -> MLMConfig:
        section, dot, name = key.partition(".")
        if not dot:
            return dataclasses.replace(self, run=dataclasses.replace(self.run, **{key: value}))
        changed = dataclasses.replace(getattr(self.run, section), **{name: value})
        return dataclasses.replace(self, run=dataclasses.replace(self.run, **{section: changed}))

    def validate(self) -> None:
        """ValueError in one line naming every problem, the run config's own rules included."""
        problems = []
        if self.hidden_size % max(1, self.heads):
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of heads "
                            f"{self.heads}")
        if not 1 <= self.min_len <= self.seq_len:
            problems.append(f"min_len must be in [1, seq_len={self.seq_len}], got "
                            f"{self.min_len}")
        if not 0 < self.mask_prob < 1:
            problems.append(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if not 0 < self.val_fraction < 1:
            problems.append(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in ("depth", "heads", "batch_size", "steps", "eval_batches", "hidden_size",
                     "mlp_expansion"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be at least 0, got {getattr(self, name)}")
        for name in ("attn_tau", "mlp_tau"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                problems.append(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.data is not None and not (isinstance(self.data, str) and self.data):
            problems.append(f"data must be a file path, or null for the embedded corpus, got "
                            f"{self.data!r}")
        for regime, rate in self.learning_rates.items():
            learning_rate_in_range(f"learning_rates.{regime}", rate,
                                   lambda path, message: problems.append(f"{path}: {message}"))
        for regime in MLM_ALLOWED_REGIMES:
            if regime not in self.learning_rates:
                problems.append(f"learning_rates has no rate for {regime}")
        for name in ("attn_tau", "mlp_tau"):
            if not getattr(self, name) <= MAX_TAU:
                problems.append(f"{name} must be at most {MAX_TAU:g}, got {getattr(self, name)}")
        known = ("auto",) + registered_names()
        if self.backend not in known:
            problems.append(f"backend must be one of {', '.join(known)}, got "
                            f"{self.backend!r}")
        if not problems:  # the training loop's own rules, on the run of one regime
            from ..training.config_files import ConfigError

            try:
                run_config(self, MLM_ALLOWED_REGIMES[0], 0, 2)
            except ConfigError as error:
                problems += [f"as a training run, {path}: {message}"
                             for path, message in error.errors]
        if problems:
            raise ValueError("invalid mlm config: " + " ".join("; ".join(problems).split()))

    def with_overrides(self, overrides: Sequence[str]) -> MLMConfig:
        """A copy with ``mlm.<field>=<value>`` (or ``<field>=<value>``) overrides applied;
        ``mlm.learning_rates.<regime>=<rate>``, or a mapping of regimes to rates, updates the
        rates of those regimes. A bad key or value is a ValueError in one line."""
        from ..training.config_files import parse_override_value

        result = self
        known = list(MLM_KEYS)
        for item in overrides:
            key, sep, text = item.partition("=")
            key = key.strip()
            name = key[len("mlm."):] if key.startswith("mlm.") else key
            field_name, dot, rest = name.partition(".")
            if not sep or field_name not in known:
                guess = difflib.get_close_matches(field_name, known, n=1)
                hint = f"; did you mean {guess[0]!r}?" if guess else ""
                raise ValueError(f"{_shown(item)}: not an mlm setting{hint} (known: "
                                 f"{', '.join(sorted(known))})")
            if dot and field_name != "learning_rates":
                raise ValueError(f"{_shown(item)}: mlm.{field_name} is a single value, not a "
                                 f"section (write mlm.{field_name}=VALUE)")
            value = parse_override_value(key, text)
            if field_name == "learning_rates":
                rates = {rest: value} if dot else value
                if not isinstance(rates, dict):
                    raise ValueError(f"{_shown(item)}: expected a mapping of regimes to "
                                     f"learning rates, e.g. {{fp32: 0.002}}")
                check_mlm_regimes([str(regime) for regime in rates])
                result = result.with_setting("learning_rates", {
                    str(regime): _number(f"mlm.learning_rates.{regime}={rate}", rate, float)
                    for regime, rate in rates.items()})
            else:
                current = getattr(result, field_name)
                if isinstance(current, (int, float)):
                    value = _number(item, value, type(current))
                elif current is not None and not isinstance(value, type(current)):
                    raise ValueError(f"{_shown(item)}: expected {type(current).__name__}")
                result = result.with_setting(field_name, value)
        result.validate()
        return result


def _shown(item: str) -> str:
    """An override as an error shows it: quoted, cut to a readable length."""
    return repr(item if len(item) <= 80 else f"{item[:40]}...{item[-20:]}")


def _number(item: str, value: Any, kind: type) -> Any:
    """``value`` as an int or a float setting: YAML's true is no number, and a float setting
    takes an int (1 for 1.0) and what YAML reads as text (``1e-3``), but an int setting takes
    no float. An int is one of 64 bits; a float is finite in float32, where it is used."""
    from ..training.config_files import FLOAT32_MAX, INT_MAX, INT_MIN, INT_RANGE

    if kind is float and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not isinstance(value, int)):
        expected = "an int" if kind is int else "a number"
        raise ValueError(f"{_shown(item)}: expected {expected}, got {reprlib.repr(value)}")
    if kind is int and not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"{_shown(item)}: integers are {INT_RANGE}")
    try:
        number = kind(value)
    except OverflowError:  # an int beyond every float
        number = math.inf
    if kind is float and math.isfinite(number) and abs(number) > FLOAT32_MAX:
        number = math.inf
    if kind is float and not math.isfinite(number):
        raise ValueError(f"{_shown(item)}: expected a finite number of float32's range "
                         f"(magnitude at most {FLOAT32_MAX:.4g})")
    return number


# ---------------------------------------------------------------- data


# ---------------------------------------------------------------- models and regimes


def build_encoder(config: MLMConfig, vocab: int, regime: str) -> nn.Module:
    """The encoder for one regime: unit-scaled or plain, with its precision simulated."""
    return encoder_from_config(run_config(config, regime, 0, vocab))


def run_config(config: MLMConfig, regime: str, seed: int, vocab: int) -> Config:
    """The training loop's config of one run of the comparison: ``config.run`` with the
    regime's model kind, precision and learning rate, the seed, and ``vocab`` characters."""
    from ..training.precision import with_model_kind
    from ..training.run_config import CompareConfig, validate

    kind, dtype, scaling = REGIME_SETTINGS[regime]
    check_mlm_regimes([regime])
    base = config.run
    result = dataclasses.replace(
        base, model=dataclasses.replace(with_model_kind(base.model, kind), vocab_size=vocab),
        precision=dataclasses.replace(base.precision, dtype=dtype, fp8=dataclasses.replace(
            base.precision.fp8, scaling=scaling)),
        training=dataclasses.replace(
            base.training, seed=seed, learning_rate=config.learning_rates[regime],
            # Checkpoints reuse the evaluation that proves their weights good.
            checkpoint_interval=base.training.eval_interval),
        compare=CompareConfig())  # a run of one regime: the comparison's rates are not its own
    validate(result)
    return result


def _task(config: MLMConfig) -> Any:
    from ..loop.tasks import MaskedLM

    return MaskedLM(min_len=config.min_len, mask_prob=config.mask_prob)


def train_mlm(config: MLMConfig, regime: str, seed: int, run_dir: Path, *,
              resume: bool = False, quiet: bool = True, desc: Optional[str] = None
              ) -> Dict[str, Any]:
    """Train one regime with one seed into `run_dir` through the training loop (or with
    `resume` continue the run there); returns its summary. A run that diverges returns its
    summary too (status ``diverged``); SIGINT and SIGTERM raise TrainingInterrupted after a
    checkpoint, as they do for every run."""
    from ..loop.run_outcomes import TrainingDiverged
    from ..loop.training_loop import train
    from ..training.data import load_corpus
    from ..training.run_directory import SUMMARY_FILE, read_json

    corpus = load_corpus(config.data, config.val_fraction, config.seq_len)
    cfg = run_config(config, regime, seed, corpus.tokenizer.vocab_size)
    label = desc or f"{regime} seed {seed}"
    try:
        train(cfg, run_dir, resume=resume, quiet=quiet, desc=label, task=_task(config))
    except TrainingDiverged as error:
        if not quiet:
            print(f"{label}: {error}")
    return read_json(Path(run_dir) / SUMMARY_FILE) or {}


# ---------------------------------------------------------------- the comparison


def _mean_std(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_mlm_compare(config: MLMConfig, regimes: Sequence[str], seeds: Sequence[int],
                    run_dir: Path, quiet: bool = False) -> List[Dict[str, Any]]:
    """Train every regime with every seed into `run_dir/<regime>-seed<k>`; one row per regime,
    over the seeds: mean (and std) final MLM loss and accuracy, and the gap to fp32.

    A run already in `run_dir` is reused (finished) or resumed (unfinished) when its saved
    settings are those it would run with now; otherwise nothing trains and a RunError names
    the settings that differ.
    """
    from ..training.data import load_corpus
    from ..training.run_directory import (
        METRICS_FILE,
        SUMMARY_FILE,
        RunLock,
        make_run_dir,
        read_json,
        remove_temporaries,
    )
    from .progress import RunCounter

    check_mlm_regimes(regimes)
    say = (lambda text: None) if quiet else print
    make_run_dir(run_dir)
    with RunLock(run_dir):
        remove_temporaries(run_dir)
        corpus = load_corpus(config.data, config.val_fraction, config.seq_len)
        vocab = corpus.tokenizer.vocab_size
        plans = [(regime, seed, _plan(run_config(config, regime, seed, vocab),
                                      config, run_dir / f"{regime}-seed{seed}", corpus.sha256,
                                      corpus.tokenizer.chars))
                 for regime in regimes for seed in seeds]
        runs: Dict[Tuple[str, int], Dict[str, Any]] = {}
        counter = RunCounter("compare", len(plans), quiet)
        for index, (regime, seed, action) in enumerate(plans, 1):
            directory = run_dir / f"{regime}-seed{seed}"
            name = f"{regime} seed {seed}"
            if action == "replace":
                say(f"{name}: {directory} holds a run of an earlier version, without a "
                    "checkpoint; training it again")
                _remove_files(directory, (SUMMARY_FILE, METRICS_FILE))
            elif action == "retrain":
                say(f"{name}: {directory} holds a finished run whose summary does not say "
                    "which model it trained; training it again")
                shutil.rmtree(directory)
            counter.start(index, name, {"reuse": f"reusing the finished run in {directory}",
                                        "resume": "resuming"}.get(action, "training"))
            if action == "reuse":
                runs[regime, seed] = read_json(directory / SUMMARY_FILE) or {}
            else:
                runs[regime, seed] = train_mlm(config, regime, seed, directory,
                                               resume=action == "resume", quiet=quiet)
            run, loss = runs[regime, seed], runs[regime, seed].get("final_val_loss")
            counter.finish(index, name, f"final MLM loss {loss:.4f}"
                           if run.get("status") == "completed" and loss is not None
                           else str(run.get("status", "missing")), trained=action != "reuse")
        return write_comparison(config, regimes, seeds, run_dir, runs)


def _plan(wanted: Config, config: MLMConfig, directory: Path, data_sha256: str,
          chars: Sequence[str]) -> str:
    """Whether to ``start``, ``resume`` or ``reuse`` the run in ``directory``, ``replace``
    the files an earlier version's loop left there, or ``retrain`` a finished run whose summary
    does not name its model; RunError when it was trained with other
    settings (or on other text, ``data_sha256``, of the characters ``chars``)."""
    from ..loop.run_opening import check_reused_tokenizer, load_run_config
    from ..loop.tasks import read_task
    from ..training.precision import model_kind
    from ..training.run_directory import (
        CHECKPOINT_FILE,
        CONFIG_FILE,
        SUMMARY_FILE,
        RunError,
        read_json,
    )

    has_checkpoint = (directory / CHECKPOINT_FILE).exists()
    summary = read_json(directory / SUMMARY_FILE)
    if summary is not None and not has_checkpoint and "regime" in summary and \
            "checkpoint_step" not in summary and not (directory / CONFIG_FILE).exists():
        # Written by the masked-LM loop of earlier versions, which kept no checkpoint: nothing
        # to continue, so it is trained again.
        return "replace"
    if not has_checkpoint and summary is None:
        return "start"  # new, or killed before anything worth keeping
    differences = setting_differences(load_run_config(directory).to_dict(), wanted.to_dict())
    task, saved_task = _task(config), read_task(directory)
    if saved_task.settings() != task.settings():
        differences.append(f"task: {saved_task.settings()} -> {task.settings()}")
    if summary is not None and summary.get("data_sha256") != data_sha256:
        differences.append("data: not the text it trained on")
    if differences:
        shown = ", ".join(differences[:4]) + (", ..." if len(differences) > 4 else "")
        raise RunError(f"{directory} was trained with other settings ({shown}); rerun with the "
                       "same settings or choose another --run-dir")
    summary = summary or {}
    status = summary.get("status")
    finished = status == "diverged" or (
        status == "completed" and summary.get("steps") == wanted.training.steps)
    if finished and summary.get("model") == model_kind(wanted.model):
        check_reused_tokenizer(directory, chars)
        return "reuse"
    if finished and "model" not in summary:
        # A summary that does not say which model it trained is not trusted to be this
        # regime's, and a resume of a finished run rewrites nothing: it is trained again.
        return "retrain"
    return "resume" if has_checkpoint else "start"


def write_comparison(config: MLMConfig, regimes: Sequence[str], seeds: Sequence[int],
                     run_dir: Path, runs: Dict[Tuple[str, int], Dict[str, Any]]
                     ) -> List[Dict[str, Any]]:
    """The rows of the table, from the runs' summaries; writes compare.md, .json and .png."""
    from ..training.run_directory import atomic_write

    def completed(run: Dict[str, Any]) -> bool:
        return run.get("status") == "completed" and run.get("final_val_loss") is not None

    rows = []
    for regime in regimes:
        done = [runs[regime, s] for s in seeds]
        finished = [run for run in done if completed(run)]
        losses = [run["final_val_loss"] for run in finished]
        accuracy = [run.get("final_val_metrics", {}).get("accuracy", math.nan)
                    for run in finished]
        gaps = []
        for seed, run in zip(seeds, done):
            reference = runs.get(("fp32", seed))
            if completed(run) and reference and completed(reference):
                gaps.append(100 * (run["final_val_loss"] - reference["final_val_loss"])
                            / reference["final_val_loss"])
        loss_mean, loss_std = _mean_std(losses)
        accuracy_mean, accuracy_std = _mean_std(accuracy)
        gap_mean, gap_std = _mean_std(gaps)
        rows.append({
            "regime": regime, "model": encoder_kind(regime),
            "learning_rate": config.learning_rates[regime],
            "completed": len(losses), "runs": len(done),
            "val_loss": loss_mean, "val_loss_std": loss_std,
            "val_accuracy": accuracy_mean, "val_accuracy_std": accuracy_std,
            "gap_to_fp32_percent": gap_mean, "gap_std": gap_std,
            "seconds": statistics.fmean(run.get("elapsed_s") or 0.0 for run in done),
            "messages": [run["message"] for run in done if run.get("message")],
        })
    table = format_mlm_table(rows, seeds)
    atomic_write(run_dir / "compare.md", (table + "\n").encode("utf-8"))
    atomic_write(run_dir / "compare.json", json.dumps(
        {"config": config.settings(), "seeds": list(seeds), "regimes": rows},
        indent=2).encode("utf-8"))
    try:
        from ..training.plots import plot_compare
        from .experiments import mean_curves

        # The mean over seeds of each regime, with a band of +-1 std (seeds that reached a step).
        curves = mean_curves({seed: {regime: [(p[0], p[1])
                                              for p in runs[regime, seed].get("val_curve", [])]
                                     for regime in regimes} for seed in seeds})
        plural = f"mean ± std over {len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]}"
        plot_compare({regime: curves.get(regime, []) for regime in regimes},
                     run_dir / "compare.png", None,
                     title=f"Validation masked-LM loss by regime: {plural}",
                     ylabel="validation MLM loss (nats per masked character)")
    except RuntimeError:  # matplotlib missing: the table is the result
        pass
    return rows


def _remove_files(directory: Path, names: Sequence[str]) -> None:
    for name in names:
        try:
            (directory / name).unlink()
        except FileNotFoundError:
            pass


def _pm(mean: Optional[float], std: Optional[float], fmt: str, suffix: str = "") -> str:
    if mean is None:
        return "-"
    return f"{mean:{fmt}}{suffix} ± {std:{fmt.lstrip('+')}}{suffix}"


def format_mlm_table(rows: Sequence[Dict[str, Any]], seeds: Sequence[int]) -> str:
    """Markdown: one row per regime, mean ± std over the seeds."""
    lines = [
        "| regime | model | precision | learning rate | MLM loss | accuracy | gap to fp32 "
        "| completed | time per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        _, dtype, scaling = REGIME_SETTINGS[row["regime"]]
        precision = dtype if dtype != "fp8" else f"fp8 {scaling}"
        lines.append(
            f"| {row['regime']} | {ENCODER_NAMES[encoder_kind(row['regime'])]} | {precision} | "
            f"{row['learning_rate']:g} | {_pm(row['val_loss'], row['val_loss_std'], '.4f')} | "
            f"{_pm(row['val_accuracy'], row['val_accuracy_std'], '.3f')} | "
            f"{_pm(row['gap_to_fp32_percent'], row['gap_std'], '+.1f', '%')} | "
            f"{row['completed']}/{row['runs']} | {row['seconds']:.0f} s |"
        )
    lines.append("")
    lines.append(f"Mean ± standard deviation over seeds {', '.join(map(str, seeds))}; MLM loss "
                 "in nats per masked character on the validation split.")
    return "\n".join(lines)
