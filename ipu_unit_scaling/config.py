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

import copy
import dataclasses
import difflib
import math
import reprlib
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml

from .fp8.config import FP8Config, FP8ConfigError
from .models import GPTConfig
from .umup_rules import ATTENTION_SCALINGS, HIDDEN_CONSTRAINTS

BACKEND_NAMES = ("auto", "ipu", "ipu_model", "emulator", "cpu", "popxl", "distributed")
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
                     "umup_attention_scaling": ATTENTION_SCALINGS}
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
MAX_SEED = 2**63 - 1
MAX_TAU = 1e6


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


# The model and FP8 sections are the library's own config classes: one definition each.
ModelConfig = GPTConfig


@dataclass
class PrecisionConfig:
    dtype: str = "fp8"
    fp8: FP8Config = field(default_factory=FP8Config)


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
    # Steps between checkpoints, which bounds the work a kill (SIGKILL, a power cut) loses;
    # the same as eval_interval, so that a checkpoint reuses the evaluation that proves it
    # good. 0: only at the end (and on SIGINT or SIGTERM).
    checkpoint_interval: int = 100


@dataclass
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
        apply_override(raw, override)
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


def read_yaml_file(path: Path, what: str = "config file") -> Any:
    """The YAML document in ``path``; any way it cannot be read is a one-line ConfigError."""
    try:
        data = path.read_bytes()
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError([("", f"cannot read {what} {str(path)!r}: {reason}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError([("", (
            f"{what} {str(path)!r} is not UTF-8 text (invalid byte 0x{data[error.start]:02x} "
            f"at offset {error.start})"
        ))]) from None
    return parse_yaml(text, f"{what} {str(path)!r}")


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` whose failures are ConfigErrors naming the line and column; values
    YAML 1.1 reads differently from YAML 1.2 (``010``, ``1:00``, ``yes``) are refused."""
    try:
        return yaml.load(text, Loader=_DecimalLoader)
    except AmbiguousValue as error:
        raise ConfigError([("", f"{where}, line {error.line}, column {error.column}: "
                                f"{error.reason}")]) from None
    except yaml.YAMLError as error:
        raise ConfigError([("", f"{where} is not valid YAML: {_yaml_problem(error)}")]) from None
    except RecursionError:
        raise ConfigError([("", f"{where} is nested too deeply to read")]) from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    problem = getattr(error, "problem", None) or str(error)
    text = " ".join(str(problem).split())
    mark = getattr(error, "problem_mark", None)
    if mark is not None:
        text = f"{at(mark)}: {text}"
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({' '.join(str(context).split())} started at {at(context_mark)})"
    return text


def _resolve_path(path: Union[str, Path]) -> Path:
    candidate = Path(path)
    named = CONFIGS_DIR / (candidate.name if candidate.suffix else candidate.name + ".yaml")
    if _is_file(candidate):
        return candidate
    if str(path) and candidate.parent == Path(".") and _is_file(named):
        return named
    if str(path) and _exists(candidate):
        raise ConfigError([("", f"config file {str(path)!r} is not a regular file")])
    raise ConfigError([("", f"config file {str(path)!r} not found (nor {named})")])


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a NUL byte or an unusable name: not a file we can read
        return False


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _read_with_extends(path: Path, seen: Tuple[Path, ...]) -> Dict[str, Any]:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in seen + (path,))
        raise ConfigError([("extends", f"cycle: {chain}")])
    data = read_yaml_file(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"{path} must hold a mapping, got {type(data).__name__}")])
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise ConfigError([("extends", f"got {_short(parent)}; expected a file path")])
    parent_path = path.parent / parent
    if not _is_file(parent_path):
        raise ConfigError([("extends", f"{_short(parent)} not found next to {path}")])
    return _deep_merge(_read_with_extends(parent_path, seen + (path,)), data)


def _deep_merge(base: Dict[str, Any], update: Dict[str, Any]) -> Dict[str, Any]:
    # Recursion is bounded by what the YAML parser could nest in the first place.
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class AmbiguousValue(yaml.YAMLError):
    """A scalar YAML 1.1 reads otherwise than YAML 1.2 and a person do (see the module notes)."""

    def __init__(self, reason: str, mark: Any) -> None:
        super().__init__(reason)
        self.reason = reason
        self.line = mark.line + 1 if mark is not None else 1
        self.column = mark.column + 1 if mark is not None else 1


_BOOLEAN_WORDS = {"yes": "true", "on": "true", "no": "false", "off": "false"}


class _DecimalLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses octal-looking, base-60 and yes/no/on/off scalars,
    tagged implicitly or explicitly (``!!int 010``); quoted, they are strings as usual."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:  # type: ignore[override]
        text = str(node.value)
        digits = text.lstrip("+-").replace("_", "")
        if ":" in digits:
            raise _base_60(text, node)
        if len(digits) > 1 and digits[0] == "0" and digits[1] not in "xXbB":
            decimal = str(int(digits))
            raise AmbiguousValue(
                f"{text} is ambiguous: YAML 1.1 reads a leading 0 as octal, YAML 1.2 as "
                f"decimal; write {text[0] if text[0] in '+-' else ''}{decimal} for the number, "
                f"or quote it ('{text}') for text", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> Any:  # type: ignore[override]
        if ":" in str(node.value):
            raise _base_60(str(node.value), node)
        return super().construct_yaml_float(node)

    def construct_yaml_bool(self, node: yaml.ScalarNode) -> Any:  # type: ignore[override]
        text = str(node.value)
        meaning = _BOOLEAN_WORDS.get(text.lower())
        if meaning is not None:
            raise AmbiguousValue(
                f"{text} is ambiguous: YAML 1.1 reads it as {meaning}, YAML 1.2 as text; "
                f"write {meaning}, or quote it ('{text}') for text", node.start_mark)
        return super().construct_yaml_bool(node)


def _base_60(text: str, node: yaml.ScalarNode) -> AmbiguousValue:
    return AmbiguousValue(
        f"{text} is ambiguous: YAML 1.1 reads it as a base-60 number, YAML 1.2 as text; write "
        f"the number in decimal, or quote it ('{text}') for text", node.start_mark)


_DecimalLoader.add_constructor("tag:yaml.org,2002:int", _DecimalLoader.construct_yaml_int)
_DecimalLoader.add_constructor("tag:yaml.org,2002:float", _DecimalLoader.construct_yaml_float)
_DecimalLoader.add_constructor("tag:yaml.org,2002:bool", _DecimalLoader.construct_yaml_bool)


def parse_override_value(key: str, text: str) -> Any:
    """The value of a ``key=text`` override, read as YAML by :func:`parse_yaml`'s rules; an
    empty text is refused (an unset shell variable should not silently mean null)."""
    if not text.strip():
        raise ConfigError([(key, "the value is empty; write null to unset it, or '' for an "
                                 "empty string")])
    try:
        return yaml.load(text, Loader=_DecimalLoader)
    except AmbiguousValue as error:
        raise ConfigError([(key, error.reason)]) from None
    except yaml.YAMLError:
        return parse_yaml(text, f"the value of {key}")  # to word the error as for files
    except RecursionError:
        raise ConfigError([(key, "the value is nested too deeply to read")]) from None


def apply_override(raw: Dict[str, Any], override: str) -> None:
    """Apply one ``section.key=value`` override to a raw mapping; the value is YAML, read by
    :func:`parse_override_value` (numbers in decimal, ambiguous spellings refused)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([("", f"override {_short(override)} must look like section.key=value")])
    value = parse_override_value(key, text)
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([(".".join(parts[: depth + 1]), "is not a section")])
        node = child
    node[parts[-1]] = value


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlevel = 2
_REPR.maxlist = _REPR.maxdict = 4


def _short(value: Any) -> str:
    """``repr`` cut to a readable length, even for hostile values (deep, huge, cyclic)."""
    try:
        return _REPR.repr(value)
    except RecursionError:
        return f"<{type(value).__name__}>"


def _build(cls: Any, raw: Any, path: str, errors: List[Tuple[str, str]]) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``raw``; records errors instead of raising."""
    if not isinstance(raw, dict):
        errors.append((path, f"got {_short(raw)}; expected a mapping of {_field_names(cls)}"))
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
            continue
        if _origin(hint_type) is dict and isinstance(value, dict):
            default = getattr(cls(), key)
            value_type = getattr(hint_type, "__args__", (Any, Any))[1]
            # A partial mapping updates the defaults; its values convert like any field's.
            value = {**default, **{k: _coerce(v, value_type) for k, v in value.items()}}
        else:
            value = _coerce(value, hint_type)
        if not _matches(value, hint_type):
            errors.append((key_path, _type_error(value, hint_type)))
            continue
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except FP8ConfigError as error:  # a section that checks its own rules
        errors.extend((f"{path}.{name}", message) for name, message in error.problems)
        return cls()


def _type_error(value: Any, hint: Any) -> str:
    return f"got {_short(value)} ({type(value).__name__}); expected {_describe(hint)}"


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
                errors.append((key_path, f"got {_short(value)}; expected a mapping"))
        elif not _matches(value, hint):
            errors.append((key_path, _type_error(value, hint)))


def _check_rules(config: Config, errors: List[Tuple[str, str]]) -> None:
    def error(path: str, message: str) -> None:
        errors.append((path, message))

    def choice(path: str, value: str, allowed: Sequence[str]) -> None:
        if value not in allowed:
            guess = difflib.get_close_matches(value, allowed, n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            error(path, f"got {_short(value)}; allowed: {', '.join(allowed)}{hint}")

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


def with_steps(config: Config, steps: int) -> Config:
    """A copy of ``config`` that trains for ``steps`` steps, validated: the one place where a
    step count given apart from ``training.steps`` (a ``--steps`` option, a function argument)
    becomes the run's length, so that the learning-rate schedule follows it."""
    changed = copy.deepcopy(config)
    changed.training.steps = steps
    validate(changed)
    return changed


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
        elif old != new:
            found.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return found
