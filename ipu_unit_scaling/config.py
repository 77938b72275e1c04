"""Run configuration: a dataclass schema loaded from YAML, with validation before anything runs.

A config file is a YAML mapping with the sections below; every key is optional and falls back to
the dataclass default, so ``Config()`` *is* the default run (``configs/default.yaml`` spells the
same values out). A file may start from another one with ``extends: other.yaml`` (a path relative
to the file; mappings merge key by key, everything else is replaced). YAML anchors and merge keys
(``<<: *base``) work inside one file as usual.

Errors name the key path, the bad value and what is allowed, e.g.
``ipu.layers_per_ipu: [2, 2] places 4 layers but model.depth is 6; ...``.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml

BACKEND_NAMES = ("auto", "ipu", "ipu_model", "emulator", "cpu", "popxl")
DTYPES = ("fp32", "fp16", "fp8")
FP8_FORMATS = ("F143", "F152", "E4M3FN", "E5M2")
FP8_SCALINGS = ("amax", "static")
FP8_ROUNDINGS = ("nearest", "stochastic")
FP8_OVERFLOWS = ("saturate", "nan")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")
PARTIALS_TYPES = ("float", "half")
PARAMETRIZATIONS = ("unit", "u-mup")
# u-μP's principled hyperparameters (model keys); all default to 1.
UMUP_MULTIPLIERS = ("residual_mult", "residual_attn_ratio", "attn_softmax_mult", "ffn_act_mult",
                    "loss_softmax_mult")
REGIMES = (
    "fp32",
    "fp16",
    "fp8-naive",
    "fp8-amax",
    "unit-fp32",
    "unit-fp16",
    "unit-fp8",
    "unit-fp8-amax",
    "umup-fp32",
    "umup-fp16",
    "umup-fp8",
    "umup-fp8-amax",
)
# Margins shift a power-of-two scaling bias that is clamped to [-31, 31] anyway.
MAX_FP8_MARGIN = 31

def _configs_dir() -> Path:
    """`configs/` of a source checkout, else the copy a non-editable install puts in its prefix."""
    checkout = Path(__file__).resolve().parent.parent / "configs"
    installed = Path(sys.prefix) / "share" / "ipu-unit-scaling" / "configs"
    return checkout if checkout.is_dir() or not installed.is_dir() else installed


CONFIGS_DIR = _configs_dir()


class ConfigError(ValueError):
    """A config that cannot run. ``errors`` lists (key path, message) pairs."""

    def __init__(self, errors: Sequence[Tuple[str, str]]):
        self.errors = list(errors)
        lines = [f"{path}: {message}" if path else message for path, message in self.errors]
        super().__init__("invalid config:\n  " + "\n  ".join(lines))


@dataclass
class ModelConfig:
    """The example GPT; field names match ``ipu_unit_scaling.models.GPTConfig``."""

    vocab_size: int = 256
    seq_len: int = 64
    depth: int = 2
    hidden_size: int = 128
    heads: int = 4
    mlp_expansion: int = 4
    dropout: float = 0.0
    unit_scaled: bool = True
    attn_tau: float = 0.2
    mlp_tau: float = 0.5
    bias: bool = False
    parametrization: str = "unit"
    residual_mult: float = 1.0
    residual_attn_ratio: float = 1.0
    attn_softmax_mult: float = 1.0
    ffn_act_mult: float = 1.0
    loss_softmax_mult: float = 1.0


@dataclass
class FP8Section:
    """Fields of ``ipu_unit_scaling.fp8.FP8Config``."""

    activation_format: str = "F143"
    weight_format: str = "F143"
    gradient_format: str = "F152"
    scaling: str = "amax"
    activation_margin: int = 0
    weight_margin: int = 0
    gradient_margin: int = 3
    rounding: str = "nearest"
    overflow: str = "saturate"
    attention: bool = False


@dataclass
class PrecisionConfig:
    dtype: str = "fp8"
    fp8: FP8Section = field(default_factory=FP8Section)


@dataclass
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


@dataclass
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
    # 0 writes a checkpoint only at the end (when checkpoint_dir is set).
    checkpoint_interval: int = 0


@dataclass
class DataConfig:
    path: Optional[str] = None  # None: the corpus embedded in the package
    val_fraction: float = 0.1


def _default_learning_rates() -> Dict[str, float]:
    # Unit-scaled models keep unit-scale weights, so Adam wants larger steps on them. Values
    # from a short sweep on the default run (see the README's compare section).
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
        # ipu_unit_scaling.umup); 1, like u-μP's other hyperparameters.
        "umup-fp32": 1.0,
        "umup-fp16": 1.0,
        "umup-fp8": 1.0,
        "umup-fp8-amax": 1.0,
    }


@dataclass
class CompareConfig:
    regimes: List[str] = field(default_factory=lambda: list(REGIMES))
    learning_rates: Dict[str, float] = field(default_factory=_default_learning_rates)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    ipu: IPUConfig = field(default_factory=IPUConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
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
    raw = _read_with_extends(_resolve_path(path), ()) if path is not None else {}
    for override in overrides:
        _apply_override(raw, override)
    config = config_from_dict(raw)
    validate(config)
    return config


def config_from_dict(raw: Any) -> Config:
    """Build a Config from nested mappings; unknown keys and wrong types raise ConfigError."""
    errors: List[Tuple[str, str]] = []
    if raw is None:
        raw = {}
    config = _build(Config, raw, "", errors)
    if errors:
        raise ConfigError(errors)
    assert isinstance(config, Config)
    return config


def _resolve_path(path: Union[str, Path]) -> Path:
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    named = CONFIGS_DIR / (candidate.name if candidate.suffix else candidate.name + ".yaml")
    if candidate.parent == Path(".") and named.is_file():
        return named
    raise ConfigError([("", f"config file {str(path)!r} not found (nor {named})")])


def _read_with_extends(path: Path, seen: Tuple[Path, ...]) -> Dict[str, Any]:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in seen + (path,))
        raise ConfigError([("extends", f"cycle: {chain}")])
    with open(path, encoding="utf-8") as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            raise ConfigError([("", f"{path} is not valid YAML: {error}")]) from error
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"{path} must hold a mapping, got {type(data).__name__}")])
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError([("extends", f"got {parent!r}; expected a file path")])
    parent_path = path.parent / parent
    if not parent_path.is_file():
        raise ConfigError([("extends", f"{parent!r} not found next to {path}")])
    return _deep_merge(_read_with_extends(parent_path, seen + (path,)), data)


def _deep_merge(base: Dict[str, Any], update: Dict[str, Any]) -> Dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _apply_override(raw: Dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([("", f"override {override!r} must look like section.key=value")])
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError([(key, f"cannot parse {text!r} as YAML: {error}")]) from error
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([(".".join(parts[: depth + 1]), "is not a section")])
        node = child
    node[parts[-1]] = value


def _build(cls: Any, raw: Any, path: str, errors: List[Tuple[str, str]]) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``raw``; records errors instead of raising."""
    if not isinstance(raw, dict):
        errors.append((path, f"got {raw!r}; expected a mapping of {_field_names(cls)}"))
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: Dict[str, Any] = {}
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            guess = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            errors.append((key_path, f"unknown key{hint} (allowed: {', '.join(names)})"))
            continue
        hint_type = hints[key]
        if dataclasses.is_dataclass(hint_type):
            kwargs[key] = _build(hint_type, value, key_path, errors)
        elif _origin(hint_type) is dict and isinstance(value, dict):
            default = getattr(cls(), key)
            value_type = getattr(hint_type, "__args__", (Any, Any))[1]
            # A partial mapping updates the defaults; its values convert like any field's.
            kwargs[key] = {**default, **{k: _coerce(v, value_type) for k, v in value.items()}}
        else:
            kwargs[key] = _coerce(value, hint_type)
    return cls(**kwargs)


def _field_names(cls: Any) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _origin(hint: Any) -> Any:
    return getattr(hint, "__origin__", None)


def _coerce(value: Any, hint: Any) -> Any:
    """Friendly conversions only: YAML reads ``1e-3`` as a string, and ints are valid floats."""
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if _origin(hint) is Union:
        for option in hint.__args__:
            converted = _coerce(value, option)
            if _matches(converted, option):
                return converted
    if _origin(hint) is list and isinstance(value, list):
        (item,) = hint.__args__
        return [_coerce(v, item) for v in value]
    if _origin(hint) is dict and isinstance(value, dict):
        return {k: _coerce(v, hint.__args__[1]) for k, v in value.items()}
    return value


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, float) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    origin = _origin(hint)
    if origin is Union:
        return any(_matches(value, option) for option in hint.__args__)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, hint.__args__[0]) for v in value)
    if origin is dict:
        key_hint, value_hint = hint.__args__
        return isinstance(value, dict) and all(
            _matches(k, key_hint) and _matches(v, value_hint) for k, v in value.items()
        )
    return isinstance(hint, type) and isinstance(value, hint)


def _describe(hint: Any) -> str:
    names = {bool: "a bool", int: "an int", float: "a finite float", str: "a string"}
    if hint in names:
        return names[hint]
    if hint is type(None):
        return "null"
    origin = _origin(hint)
    if origin is Union:
        return " or ".join(_describe(option) for option in hint.__args__)
    if origin is list:
        return f"a list of {_describe(hint.__args__[0]).split(' ', 1)[-1]}s"
    if origin is dict:
        return f"a mapping of names to {_describe(hint.__args__[1]).split(' ', 1)[-1]}s"
    return getattr(hint, "__name__", str(hint))


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
                errors.append((key_path, f"got {value!r}; expected a mapping"))
        elif not _matches(value, hint):
            kind = type(value).__name__
            errors.append((key_path, f"got {value!r} ({kind}); expected {_describe(hint)}"))


def _check_rules(config: Config, errors: List[Tuple[str, str]]) -> None:
    def error(path: str, message: str) -> None:
        errors.append((path, message))

    def choice(path: str, value: str, allowed: Sequence[str]) -> None:
        if value not in allowed:
            guess = difflib.get_close_matches(value, allowed, n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            error(path, f"got {value!r}; allowed: {', '.join(allowed)}{hint}")

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
        if not getattr(model, name) > 0:
            error(f"model.{name}", f"got {getattr(model, name)!r}; must be > 0")
    _check_parametrization(model, error, choice)

    precision = config.precision
    choice("precision.dtype", precision.dtype, DTYPES)
    fp8 = precision.fp8
    for name in ("activation_format", "weight_format", "gradient_format"):
        choice(f"precision.fp8.{name}", getattr(fp8, name), FP8_FORMATS)
    choice("precision.fp8.scaling", fp8.scaling, FP8_SCALINGS)
    choice("precision.fp8.rounding", fp8.rounding, FP8_ROUNDINGS)
    choice("precision.fp8.overflow", fp8.overflow, FP8_OVERFLOWS)
    for name in ("activation_margin", "weight_margin", "gradient_margin"):
        margin = getattr(fp8, name)
        if abs(margin) > MAX_FP8_MARGIN:
            error(f"precision.fp8.{name}", f"got {margin}; allowed: -31 .. 31")

    _check_ipu(config, error)
    _check_training(config, error, choice, at_least)

    if not 0.0 < config.data.val_fraction < 1.0:
        error("data.val_fraction", f"got {config.data.val_fraction!r}; allowed: 0 < x < 1")

    for index, regime in enumerate(config.compare.regimes):
        choice(f"compare.regimes[{index}]", regime, REGIMES)
    if len(set(config.compare.regimes)) != len(config.compare.regimes):
        error("compare.regimes", f"got {config.compare.regimes}; each regime at most once")
    for regime, rate in config.compare.learning_rates.items():
        choice(f"compare.learning_rates.{regime}", regime, REGIMES)
        if not rate > 0:
            error(f"compare.learning_rates.{regime}", f"got {rate!r}; must be > 0")

    choice("backend", config.backend, BACKEND_NAMES)


def _check_parametrization(model: ModelConfig, error: Any, choice: Any) -> None:
    """u-μP's keys act only under u-μP, unit scaling's taus only under unit scaling: a value
    that would be ignored is refused instead."""
    choice("model.parametrization", model.parametrization, PARAMETRIZATIONS)
    for name in UMUP_MULTIPLIERS:
        value = getattr(model, name)
        if not value > 0:
            error(f"model.{name}", f"got {value!r}; must be > 0")
        elif value != 1.0 and model.parametrization != "u-mup":
            error(f"model.{name}", f"got {value!r}; only model.parametrization: u-mup uses it")
    if model.parametrization != "u-mup":
        return
    if not model.unit_scaled:
        error("model.parametrization", "u-mup needs model.unit_scaled: true")
    defaults = ModelConfig()
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
                f"got {proportion} ({len(values)} values); expected one, or one per IPU "
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
    if not training.learning_rate > 0:
        error("training.learning_rate", f"got {training.learning_rate!r}; must be > 0")
    at_least("training.weight_decay", training.weight_decay, 0.0)
    at_least("training.warmup_steps", training.warmup_steps, 0)
    if training.warmup_steps > training.steps:
        error(
            "training.warmup_steps",
            f"got {training.warmup_steps}; must be <= training.steps ({training.steps})",
        )
    if training.grad_clip is not None and not training.grad_clip > 0:
        error("training.grad_clip", f"got {training.grad_clip!r}; must be > 0 or null")
    at_least("training.log_interval", training.log_interval, 1)
    at_least("training.eval_interval", training.eval_interval, 0)
    at_least("training.eval_batches", training.eval_batches, 1)
    at_least("training.checkpoint_interval", training.checkpoint_interval, 0)


def resolve_layers_per_ipu(layers_per_ipu: Sequence[int], depth: int, ipus: int) -> List[int]:
    """Explicit layer counts per IPU; ``-1`` entries share the remaining layers evenly.

    When the rest does not divide evenly the later ``-1`` IPUs take one more layer each,
    because the first IPU also holds the embeddings. Raises ValueError with the reason.
    """
    counts = list(layers_per_ipu)
    if len(counts) != ipus:
        raise ValueError(
            f"got {counts} ({len(counts)} entries); expected one entry per IPU "
            f"(ipu.ipus_per_replica = {ipus})"
        )
    if any(c < -1 for c in counts):
        raise ValueError(f"got {counts}; entries must be >= 0, or -1 for 'share the rest'")
    fixed = sum(c for c in counts if c >= 0)
    flexible = [i for i, c in enumerate(counts) if c == -1]
    if not flexible:
        if fixed != depth:
            raise ValueError(f"{counts} places {fixed} layers but model.depth is {depth}")
        return counts
    rest = depth - fixed
    if rest < len(flexible):
        raise ValueError(
            f"{counts} leaves {rest} of model.depth = {depth} layers for {len(flexible)} "
            "'-1' entries; each needs at least one"
        )
    share, extra = divmod(rest, len(flexible))
    for rank, index in enumerate(flexible):
        counts[index] = share + (1 if rank >= len(flexible) - extra else 0)
    return counts


def scheduled_learning_rate(training: TrainingConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then constant or
    cosine decay to zero at ``training.steps``."""
    peak = training.learning_rate
    if step < training.warmup_steps:
        return peak * (step + 1) / training.warmup_steps
    if training.schedule == "constant":
        return peak
    decay_steps = max(1, training.steps - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / decay_steps)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
