"""Run configuration: a dataclass schema loaded from YAML, with validation before anything runs.

A config file is a YAML mapping with the sections below; every key is optional and falls back to
the dataclass default, so ``Config()`` *is* the default run (``configs/default.yaml`` spells the
same values out). The ``model`` section is ``models.GPTConfig`` and ``precision.fp8`` is
``fp8.FP8Config``: the library's own classes, so a key cannot be in one and not the other.

A file may start from another one with ``extends: other.yaml`` (a path relative
to the file; mappings merge key by key, everything else is replaced). YAML anchors and merge keys
(``<<: *base``) work inside one file as usual.

Numbers mean what they say in decimal. YAML 1.1, which PyYAML follows, reads ``010`` as octal 8,
``1:00`` as base 60 and ``yes``/``no``/``on``/``off`` as booleans, where YAML 1.2 and a person
read ten, a time and words: such values are refused, in config files and in overrides alike,
with the spelling that says either meaning (``10``, ``'010'``, ``true``). Everything else is
read as YAML 1.1 reads it (``0x10`` is 16, ``1_000`` is 1000, ``1e-3`` a float).

Errors name the key path, the bad value and what is allowed, e.g.
``ipu.layers_per_ipu: [2, 2] places 4 layers but model.depth is 6; ...``; a file that cannot be
read (missing, not UTF-8, not YAML, nested too deeply) is a ConfigError too, with the line and
column of a YAML error.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..fp8.fp8_config import FP8Config
from ..models.gpt import GPTConfig
from ..parametrization.umup_rules import ATTENTION_SCALINGS, GELU_CONSTRAINTS, HIDDEN_CONSTRAINTS
from .config_files import (
    ConfigError,
    apply_override,
    build_section,
    matches_hint,
    parse_override_value,
    read_with_extends,
    resolve_config_path,
    short_repr,
    type_error_message,
)
from .config_names import MAX_SEED, REGIMES
from .run_health import TelemetryConfig, telemetry_problems

# A backend is named here and chosen by the registry of backends
# (:mod:`ipu_unit_scaling.backends.registry`), which refuses a name it does not hold.
BACKEND_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
DTYPES = ("fp32", "fp16", "fp8")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")
PARTIALS_TYPES = ("float", "half")
PARAMETRIZATIONS = ("unit", "u-mup")
# u-μP's principled hyperparameters (model keys); all default to 1.
UMUP_MULTIPLIERS = ("residual_mult", "residual_attn_ratio", "attn_softmax_mult", "ffn_act_mult",
                    "loss_softmax_mult")
# u-μP's rules with a choice (model keys) and their choices; the first is the default.
UMUP_RULE_CHOICES = {"umup_hidden_constraint": HIDDEN_CONSTRAINTS,
                     "umup_attention_scaling": ATTENTION_SCALINGS,
                     "umup_gelu_constraint": GELU_CONSTRAINTS}
MAX_TAU = 1e6
# A learning rate meets float32 numbers in the optimizer step, multiplied by more than itself:
# Adam divides it by 1 - beta1 = 0.1 at the first step, u-μP multiplies it by per-tensor
# scales (below 2**20 at any width a CPU or an IPU trains), AdamW by the weight decay. With a
# rate of at most 2**100 and a weight decay of at most 2**20 none of these leaves float32's
# range (2**128); below 2**-100 a rate scaled down by u-μP comes near float32's smallest.
MIN_LEARNING_RATE, MAX_LEARNING_RATE = 2.0**-100, 2.0**100
MAX_WEIGHT_DECAY = 2.0**20
LEARNING_RATE_RANGE = "2**-100 <= x <= 2**100"



@dataclass(frozen=True)
class PrecisionConfig:
    dtype: str = "fp8"
    fp8: FP8Config = field(default_factory=FP8Config)


@dataclass(frozen=True)
class IPUConfig:
    """How PopTorch places and batches the model (also the stage split of the fallbacks)."""

    ipus_per_replica: int = 1
    # Transformer layers on each IPU of a replica; -1 entries share the rest evenly.
    layers_per_ipu: List[int] = field(default_factory=lambda: [-1])
    device_iterations: int = 1
    gradient_accumulation: int = 1
    replication_factor: int = 1
    # One proportion for every IPU, or one per IPU; None keeps Poplar's default.
    available_memory_proportion: Optional[Union[float, List[float]]] = None
    partials_type: str = "float"
    stochastic_rounding: bool = False
    executable_cache_dir: Optional[str] = None
    auto_round_num_ipus: bool = False


@dataclass(frozen=True)
class TrainingConfig:
    # Samples per optimizer step, over all micro-batches and replicas.
    batch_size: int = 16
    steps: int = 500
    optimizer: str = "adam"
    learning_rate: float = 0.06
    weight_decay: float = 0.0
    schedule: str = "cosine"
    warmup_steps: int = 50
    grad_clip: Optional[float] = None
    seed: int = 0
    log_interval: int = 20
    eval_interval: int = 100
    eval_batches: int = 8
    checkpoint_dir: Optional[str] = None
    # Steps between checkpoints, which bounds the work a kill (SIGKILL, a power cut) loses;
    # the same as eval_interval, so that a checkpoint reuses the evaluation that proves it
    # good. 0: only at the end (and on SIGINT or SIGTERM).
    checkpoint_interval: int = 100


@dataclass(frozen=True)
class DataConfig:
    path: Optional[str] = None  # None: the corpus embedded in the package
    val_fraction: float = 0.1


def _default_learning_rates() -> Dict[str, float]:
    # Unit-scaled models keep unit-scale weights, so Adam wants larger steps on them. Values
    # from a short sweep on the default run (see docs/guide/compare.md).
    return {
        "fp32": 0.006,
        "fp16": 0.006,
        "fp8-naive": 0.006,
        "fp8-amax": 0.006,
        "unit-fp32": 0.06,
        "unit-fp16": 0.06,
        "unit-fp8": 0.06,
        "unit-fp8-amax": 0.06,
        # u-μP's global rate eta: each tensor's own rate is eta times its scale (see
        # ipu_unit_scaling.parametrization.umup); 1, like u-μP's other hyperparameters.
        "umup-fp32": 1.0,
        "umup-fp16": 1.0,
        "umup-fp8": 1.0,
        "umup-fp8-amax": 1.0,
    }


@dataclass(frozen=True)
class CompareConfig:
    regimes: List[str] = field(default_factory=lambda: list(REGIMES))
    learning_rates: Dict[str, float] = field(default_factory=_default_learning_rates)


@dataclass(frozen=True)
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    ipu: IPUConfig = field(default_factory=IPUConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    backend: str = "auto"

    def to_dict(self) -> Dict[str, Any]:
        """Plain nested dict (YAML/JSON friendly); ``config_from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @property
    def micro_batch_size(self) -> int:
        """Samples in one forward pass of one replica."""
        ipu = self.ipu
        return self.training.batch_size // (ipu.gradient_accumulation * ipu.replication_factor)

    @property
    def samples_per_call(self) -> int:
        """Leading dimension of the inputs of one training-model call (PopTorch's rule)."""
        return self.training.batch_size * self.ipu.device_iterations

    @property
    def total_ipus(self) -> int:
        return self.ipu.ipus_per_replica * self.ipu.replication_factor


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: Union[str, Path, None] = None, overrides: Sequence[str] = ()) -> Config:
    """Load, override and validate a config.

    ``path`` is a YAML file, or the name of a file in the ``configs/`` directory (``"fp32"``), or
    None for the default run. ``overrides`` are ``"section.key=value"`` strings whose values are
    parsed as YAML (``training.steps=10``, ``ipu.layers_per_ipu=[2,2]``). Raises ConfigError.
    """
    raw = read_with_extends(resolve_config_path(path), ()) if path is not None else {}
    for override in overrides:
        apply_override(raw, override)
    config = config_from_dict(raw)
    validate(config)
    return config


def config_from_dict(raw: Any) -> Config:
    """Build a Config from nested mappings; unknown keys and wrong types raise ConfigError."""
    errors: List[Tuple[str, str]] = []
    if raw is None:
        raw = {}
    config = build_section(Config, raw, "", errors)
    if errors:
        raise ConfigError(errors)
    assert isinstance(config, Config)
    return config


# ---------------------------------------------------------------------------------------------
# Validation


def validate(config: Config) -> None:
    """Check types and cross-field rules; raise one ConfigError listing every problem."""
    errors: List[Tuple[str, str]] = []
    _check_types(config, "", errors)
    if errors:  # the rules below assume well-typed values
        raise ConfigError(errors)
    _check_rules(config, errors)
    if errors:
        raise ConfigError(errors)


def _check_types(node: Any, path: str, errors: List[Tuple[str, str]]) -> None:
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key_path = f"{path}.{f.name}" if path else f.name
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if isinstance(value, hint):
                _check_types(value, key_path, errors)
            else:
                errors.append((key_path, f"got {short_repr(value)}; expected a mapping"))
        elif not matches_hint(value, hint):
            errors.append((key_path, type_error_message(value, hint)))


def _check_rules(config: Config, errors: List[Tuple[str, str]]) -> None:
    def error(path: str, message: str) -> None:
        errors.append((path, message))

    def choice(path: str, value: str, allowed: Sequence[str]) -> None:
        if value not in allowed:
            guess = difflib.get_close_matches(value, allowed, n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            error(path, f"got {short_repr(value)}; allowed: {', '.join(allowed)}{hint}")

    def at_least(path: str, value: float, low: float) -> None:
        if value < low:
            error(path, f"got {value!r}; must be >= {low}")

    model = config.model
    for name in ("vocab_size", "seq_len", "depth", "hidden_size", "heads", "mlp_expansion"):
        at_least(f"model.{name}", getattr(model, name), 1)
    if model.heads >= 1 and model.hidden_size % model.heads:
        error(
            "model.heads",
            f"got {model.heads}; must divide model.hidden_size ({model.hidden_size})",
        )
    if not 0.0 <= model.dropout < 1.0:
        error("model.dropout", f"got {model.dropout!r}; allowed: 0 <= dropout < 1")
    for name in ("attn_tau", "mlp_tau"):
        # Past MAX_TAU the skip path's weight 1 / sqrt(1 + tau**2) is below 1e-6: no residual.
        if not 0 < getattr(model, name) <= MAX_TAU:
            error(f"model.{name}", f"got {getattr(model, name)!r}; allowed: 0 < tau <= {MAX_TAU:g}")
    _check_parametrization(model, error, choice)

    # precision.fp8 is an FP8Config, which refuses bad values itself when it is built.
    choice("precision.dtype", config.precision.dtype, DTYPES)

    _check_ipu(config, error)
    _check_training(config, error, choice, at_least)

    if not 0.0 < config.data.val_fraction < 1.0:
        error("data.val_fraction", f"got {config.data.val_fraction!r}; allowed: 0 < x < 1")
    if config.data.path is not None and not config.data.path.strip():
        error("data.path", f"got {config.data.path!r}; expected a file path, or null for the "
                           "embedded corpus")

    for index, regime in enumerate(config.compare.regimes):
        choice(f"compare.regimes[{index}]", regime, REGIMES)
    if not config.compare.regimes:
        error("compare.regimes", "got []; name at least one regime")
    if len(set(config.compare.regimes)) != len(config.compare.regimes):
        error("compare.regimes",
              f"got {short_repr(config.compare.regimes)}; each regime at most once")
    for regime, rate in config.compare.learning_rates.items():
        choice(f"compare.learning_rates.{regime}", regime, REGIMES)
        learning_rate_in_range(f"compare.learning_rates.{regime}", rate, error)

    if not BACKEND_NAME.fullmatch(config.backend):
        error("backend", f"got {short_repr(config.backend)}; a backend's name is lowercase "
                         "letters, digits and underscores, at most 40 characters (auto, cpu, "
                         "emulator, ipu, ...)")


def learning_rate_in_range(path: str, rate: float, error: Any) -> None:
    """``error(path, message)`` unless ``rate`` is a learning rate a run can take."""
    if not rate > 0:
        error(path, f"got {rate!r}; must be > 0")
    elif not MIN_LEARNING_RATE <= rate <= MAX_LEARNING_RATE:
        error(path, f"got {rate!r}; allowed: {LEARNING_RATE_RANGE} (float32 numbers in the "
                    "optimizer step)")


def _check_parametrization(model: GPTConfig, error: Any, choice: Any) -> None:
    """u-μP's keys act only under u-μP, unit scaling's taus only under unit scaling: a value
    that would be ignored is refused instead."""
    choice("model.parametrization", model.parametrization, PARAMETRIZATIONS)
    for name in UMUP_MULTIPLIERS:
        value = getattr(model, name)
        # Beyond 1e6 the squared shares and scales leave float range or stop meaning anything.
        if not 0 < value <= MAX_TAU:
            error(f"model.{name}", f"got {value!r}; allowed: 0 < x <= {MAX_TAU:g}")
        elif value != 1.0 and model.parametrization != "u-mup":
            error(f"model.{name}", f"got {value!r}; only model.parametrization: u-mup uses it")
    for name, choices in UMUP_RULE_CHOICES.items():
        value = getattr(model, name)
        choice(f"model.{name}", value, choices)
        if value != choices[0] and model.parametrization != "u-mup":
            error(f"model.{name}", f"got {value!r}; only model.parametrization: u-mup uses it")
    if model.parametrization != "u-mup":
        return
    if not model.unit_scaled:
        error("model.parametrization", "u-mup needs model.unit_scaled: true")
    defaults = GPTConfig()
    for name in ("attn_tau", "mlp_tau"):
        if getattr(model, name) != getattr(defaults, name):
            error(f"model.{name}", "u-mup sets each layer's residual weights from "
                  "model.residual_mult and model.residual_attn_ratio; leave it at its default")


def _check_ipu(config: Config, error: Any) -> None:
    ipu = config.ipu
    for name in ("ipus_per_replica", "device_iterations", "gradient_accumulation"):
        if getattr(ipu, name) < 1:
            error(f"ipu.{name}", f"got {getattr(ipu, name)}; must be >= 1")
    if ipu.replication_factor < 1:
        error("ipu.replication_factor", f"got {ipu.replication_factor}; must be >= 1")
    if ipu.partials_type not in PARTIALS_TYPES:
        error("ipu.partials_type", f"got {ipu.partials_type!r}; allowed: float, half")

    try:
        resolve_layers_per_ipu(ipu.layers_per_ipu, config.model.depth, ipu.ipus_per_replica)
    except ValueError as problem:
        error("ipu.layers_per_ipu", str(problem))

    total = ipu.ipus_per_replica * ipu.replication_factor
    if total >= 1 and total & (total - 1) and not ipu.auto_round_num_ipus:
        error(
            "ipu.replication_factor",
            f"ipu.ipus_per_replica x ipu.replication_factor = {ipu.ipus_per_replica} x "
            f"{ipu.replication_factor} = {total} IPUs, not a power of two; change either, or "
            "set ipu.auto_round_num_ipus: true to let PopTorch round up",
        )

    if ipu.ipus_per_replica > 1:
        # A pipelined training step runs 2 x IPUs - 1 forward/backward stages; each needs
        # its own micro-batch in flight, so fewer accumulation steps cannot fill it.
        needed = 2 * ipu.ipus_per_replica - 1
        if ipu.gradient_accumulation < needed:
            error(
                "ipu.gradient_accumulation",
                f"got {ipu.gradient_accumulation}; a {ipu.ipus_per_replica}-IPU pipeline "
                f"needs at least 2 x {ipu.ipus_per_replica} - 1 = {needed}",
            )

    proportion = ipu.available_memory_proportion
    if proportion is not None:
        values = proportion if isinstance(proportion, list) else [proportion]
        if isinstance(proportion, list) and len(values) != ipu.ipus_per_replica:
            error(
                "ipu.available_memory_proportion",
                f"got {short_repr(proportion)} ({len(values)} values); expected one, or one per "
                f"IPU "
                f"(ipu.ipus_per_replica = {ipu.ipus_per_replica})",
            )
        for value in values:
            if not 0.0 < value <= 1.0:
                error("ipu.available_memory_proportion", f"got {value!r}; allowed: 0 < x <= 1")


def _check_training(config: Config, error: Any, choice: Any, at_least: Any) -> None:
    training = config.training
    ipu = config.ipu
    at_least("training.batch_size", training.batch_size, 1)
    replicas_and_steps = ipu.gradient_accumulation * ipu.replication_factor
    if replicas_and_steps >= 1 and training.batch_size % replicas_and_steps:
        error(
            "training.batch_size",
            f"got {training.batch_size}; must be a multiple of ipu.gradient_accumulation x "
            f"ipu.replication_factor = {ipu.gradient_accumulation} x "
            f"{ipu.replication_factor} = {replicas_and_steps} (micro-batches per step)",
        )
    at_least("training.steps", training.steps, 1)
    choice("training.optimizer", training.optimizer, OPTIMIZERS)
    choice("training.schedule", training.schedule, SCHEDULES)
    learning_rate_in_range("training.learning_rate", training.learning_rate, error)
    if not 0.0 <= training.weight_decay <= MAX_WEIGHT_DECAY:
        error("training.weight_decay", f"got {training.weight_decay!r}; allowed: "
                                       "0 <= x <= 2**20")
    at_least("training.warmup_steps", training.warmup_steps, 0)
    if ipu.device_iterations >= 1 and training.steps % ipu.device_iterations:
        # Each call of the training model runs device_iterations steps; a last, shorter call
        # is not possible (PopTorch compiles one step count).
        error(
            "training.steps",
            f"got {training.steps}; must be a multiple of ipu.device_iterations "
            f"({ipu.device_iterations}), the steps one call of the training model runs",
        )
    if not 0 <= training.seed <= MAX_SEED:
        # The validation batches use seed + 1, which must still fit torch's 64-bit seeds.
        error("training.seed", f"got {training.seed}; allowed: 0 .. 2**63 - 1")
    if training.grad_clip is not None and not training.grad_clip > 0:
        error("training.grad_clip", f"got {training.grad_clip!r}; must be > 0 or null")
    at_least("training.log_interval", training.log_interval, 1)
    at_least("training.eval_interval", training.eval_interval, 0)
    at_least("training.eval_batches", training.eval_batches, 1)
    at_least("training.checkpoint_interval", training.checkpoint_interval, 0)
    for key, message in telemetry_problems(config.telemetry):
        error(f"telemetry.{key}", message)


def resolve_layers_per_ipu(layers_per_ipu: Sequence[int], depth: int, ipus: int) -> List[int]:
    """Explicit layer counts per IPU; ``-1`` entries share the remaining layers evenly.

    When the rest does not divide evenly the later ``-1`` IPUs take one more layer each,
    because the first IPU also holds the embeddings. Raises ValueError with the reason.
    """
    counts = list(layers_per_ipu)
    if len(counts) != ipus:
        raise ValueError(
            f"got {short_repr(counts)} ({len(counts)} entries); expected one entry per IPU "
            f"(ipu.ipus_per_replica = {ipus})"
        )
    if any(c < -1 for c in counts):
        raise ValueError(f"got {short_repr(counts)}; entries must be >= 0, or -1 for 'share the "
                         "rest'")
    fixed = sum(c for c in counts if c >= 0)
    flexible = [i for i, c in enumerate(counts) if c == -1]
    if not flexible:
        if fixed != depth:
            raise ValueError(f"{short_repr(counts)} places {fixed} layers but model.depth is "
                             f"{depth}")
        return counts
    rest = depth - fixed
    if rest < len(flexible):
        raise ValueError(
            f"{short_repr(counts)} leaves {rest} of model.depth = {depth} layers for "
            f"{len(flexible)} "
            "'-1' entries; each needs at least one"
        )
    share, extra = divmod(rest, len(flexible))
    for rank, index in enumerate(flexible):
        counts[index] = share + (1 if rank >= len(flexible) - extra else 0)
    return counts


def earlier_run_settings(raw: Dict[str, Any]) -> List[str]:
    """Fill, in a saved run config ``raw``, the keys added since runs were saved without them,
    each with the value such a run trained with (not today's default, where that changed: a
    u-μP run saved before ``model.umup_attention_scaling`` scaled attention per row, one saved
    before ``model.umup_gelu_constraint`` tied its GELU's scales by gmean). Returns
    the keys filled."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return []
    umup = model.get("parametrization") == "u-mup"
    earlier = {"factory": None, "umup_hidden_constraint": "gmean",
               "umup_attention_scaling": "per-row" if umup else "constant",
               "umup_gelu_constraint": "gmean" if umup else "to_output_scale"}
    filled = [key for key in earlier if key not in model]
    for key in filled:
        model[key] = earlier[key]
    return [f"model.{key}" for key in filled]


def warmup_steps(training: TrainingConfig) -> int:
    """The warmup actually used: ``training.warmup_steps``, at most the whole run."""
    return min(training.warmup_steps, training.steps)


def scheduled_learning_rate(training: TrainingConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup (clamped to the run
    length), then constant or cosine decay to zero at ``training.steps``."""
    peak = training.learning_rate
    warmup = warmup_steps(training)
    if step < warmup:
        return peak * (step + 1) / warmup
    if training.schedule == "constant":
        return peak
    decay_steps = max(1, training.steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def setting_differences(saved: Dict[str, Any], wanted: Dict[str, Any],
                        prefix: str = "") -> List[str]:
    """``key: saved -> wanted`` for each setting of two config dicts that differs (the compare
    section aside: it holds no setting of one run)."""
    found = []
    for key in sorted(set(saved) | set(wanted)):
        if not prefix and key == "compare":
            continue
        old, new = saved.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict) and not prefix:
            found += setting_differences(old, new, key + ".")
        elif f"{prefix}{key}" == "data.path" and absolute_path(old) == absolute_path(new):
            continue  # the same file, named from the working directory or absolutely
        elif old != new:
            found.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return found


def absolute_path(path: Any) -> Any:
    """A ``data.path`` given relative to the working directory, made absolute (other values
    as they are): a run saves its text's path so, to be resumed, evaluated or sampled from
    any directory."""
    if not isinstance(path, str) or not path.strip():
        return path
    try:
        return os.path.abspath(path)
    except (OSError, ValueError):  # a NUL byte: refused where the file is opened
        return path


def absolute_path_override(override: str) -> str:
    """A ``data.path=VALUE`` override with a relative path made absolute (as
    :func:`absolute_path`); every other override as it is."""
    key, sep, text = override.partition("=")
    if not sep or key.strip() != "data.path":
        return override
    try:
        value = parse_override_value(key.strip(), text)
    except ConfigError:
        return override  # refused with its reason where it is applied
    absolute = absolute_path(value)
    return override if absolute == value else f"data.path={json.dumps(absolute)}"
