"""Reading run configs: YAML files (with ``extends``, and YAML 1.1's ambiguous spellings refused),
``--set KEY=VALUE`` overrides, and typed config sections built from the values read, each
problem a :class:`ConfigError` naming its key. The schema and its rules are
:mod:`.run_config`'s.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import sys
import typing
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, Union

import yaml


def _configs_dir() -> Path:
    """`configs/` of a source checkout, else the copy a non-editable install puts in its prefix."""
    checkout = Path(__file__).resolve().parents[2] / "configs"
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


def resolve_config_path(path: Union[str, Path]) -> Path:
    """The config file ``path`` names: the path itself, or a file of ``configs/`` by name."""
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


def read_with_extends(path: Path, seen: Tuple[Path, ...]) -> Dict[str, Any]:
    """The mapping of ``path`` merged over the files it ``extends:`` (``seen``: refuses cycles)."""
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
        raise ConfigError([("extends", f"got {short_repr(parent)}; expected a file path")])
    parent_path = path.parent / parent
    if not _is_file(parent_path):
        raise ConfigError([("extends", f"{short_repr(parent)} not found next to {path}")])
    return _deep_merge(read_with_extends(parent_path, seen + (path,)), data)


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
    """A scalar YAML 1.1 reads otherwise than YAML 1.2 and a person do (see the module notes),
    or another spelling a config refuses where it is read: an integer of more digits than
    any setting takes, a key written twice in one mapping."""

    def __init__(self, reason: str, mark: Any) -> None:
        super().__init__(reason)
        self.reason = reason
        self.line = mark.line + 1 if mark is not None else 1
        self.column = mark.column + 1 if mark is not None else 1


_BOOLEAN_WORDS = {"yes": "true", "on": "true", "no": "false", "off": "false"}

# Integers a config holds are 64-bit, as torch's; a longer spelling is refused as it is read
# (Python itself refuses to read decimal integers of more than 4300 digits).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
INT_RANGE = "-2**63 .. 2**63 - 1"
# Floats a config holds become float32 numbers (a learning rate in an optimizer step, say):
# a larger magnitude overflows there.
FLOAT32_MAX = 3.4028234663852886e38
_MAX_INT_DIGITS = 40
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _DecimalLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses octal-looking, base-60 and yes/no/on/off scalars,
    tagged implicitly or explicitly (``!!int 010``); quoted, they are strings as usual."""

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_duplicate_keys(node)  # before merge keys (<<) are flattened into the mappings
        return super().construct_document(node)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:  # type: ignore[override]
        text = str(node.value)
        digits = text.lstrip("+-").replace("_", "")
        if ":" in digits:
            raise _base_60(text, node)
        if len(digits) > _MAX_INT_DIGITS:
            raise AmbiguousValue(
                f"{_cut(text)} ({len(digits)} digits) is too large: integers in a config are "
                f"{INT_RANGE}", node.start_mark)
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


def _cut(text: str, most: int = 24) -> str:
    return text if len(text) <= most else f"{text[:10]}...{text[-10:]}"


def _refuse_duplicate_keys(root: yaml.Node) -> None:
    """AmbiguousValue at the second of two equal keys of one mapping (YAML would keep the
    last silently, so a section written twice would lose the first). Keys that a merge key
    (``<<: *base``) brings in may be overridden, as usual."""
    seen_nodes = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:  # an alias: the node is checked once
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: Dict[Tuple[str, str], Any] = {}
            for key, value in node.value:
                stack.append(value)
                if key.tag == _MERGE_TAG or not isinstance(key, yaml.ScalarNode):
                    stack.append(key)
                    continue
                earlier = first.setdefault((key.tag, key.value), key)
                if earlier is not key:
                    mark = earlier.start_mark
                    where = f" (first at line {mark.line + 1})" if mark is not None else ""
                    raise AmbiguousValue(
                        f"duplicate key {_cut(str(key.value))!r}{where}; YAML would keep only "
                        "the last, so write each key once (merge the two)", key.start_mark)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


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
    undecodable = [ch for ch in text if "\udc80" <= ch <= "\udcff"]  # bytes not UTF-8
    if undecodable:
        byte = ord(undecodable[0]) - 0xDC00
        raise ConfigError([(key, f"the value is not UTF-8 text (byte 0x{byte:02x}); a config "
                                 "takes UTF-8 paths and names")])
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
        raise ConfigError([("", f"override {short_repr(override)} must look like "
                                "section.key=value")])
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


def short_repr(value: Any) -> str:
    """``repr`` cut to a readable length, even for hostile values (deep, huge, cyclic)."""
    try:
        return _REPR.repr(value)
    except RecursionError:
        return f"<{type(value).__name__}>"
    except ValueError:  # repr refuses an int of more than 4300 digits
        if isinstance(value, int):
            return f"an integer of {value.bit_length()} bits"
        return f"<{type(value).__name__}>"


def build_section(cls: Any, raw: Any, path: str, errors: List[Tuple[str, str]]) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``raw``; records errors instead of raising."""
    if not isinstance(raw, dict):
        errors.append((path, f"got {short_repr(raw)}; expected a mapping of {_field_names(cls)}"))
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
            kwargs[key] = build_section(hint_type, value, key_path, errors)
            continue
        if _origin(hint_type) is dict and isinstance(value, dict):
            default = getattr(cls(), key)
            value_type = getattr(hint_type, "__args__", (Any, Any))[1]
            # A partial mapping updates the defaults; its values convert like any field's.
            value = {**default, **{k: _coerce(v, value_type) for k, v in value.items()}}
        else:
            value = _coerce(value, hint_type)
        if not matches_hint(value, hint_type):
            if _origin(hint_type) is dict and isinstance(value, dict):
                # Each entry by its own key path (compare.learning_rates.fp32: ...).
                key_hint, value_hint = hint_type.__args__
                errors.extend((f"{key_path}.{k}", type_error_message(v, value_hint))
                              for k, v in value.items()
                              if matches_hint(k, key_hint) and not matches_hint(v, value_hint))
                if all(matches_hint(k, key_hint) for k in value):
                    continue
            errors.append((key_path, type_error_message(value, hint_type)))
            continue
        kwargs[key] = value
    from ..fp8.fp8_config import FP8ConfigError  # here: reading a file needs no torch

    try:
        return cls(**kwargs)
    except FP8ConfigError as error:  # a section that checks its own rules
        errors.extend((f"{path}.{name}", message) for name, message in error.problems)
        return cls()


def type_error_message(value: Any, hint: Any) -> str:
    """The message of a config value that is not of the type ``hint`` (or out of its range)."""
    return _out_of_range(value, hint) or \
        f"got {short_repr(value)} ({type(value).__name__}); expected {_describe(hint)}"


def _out_of_range(value: Any, hint: Any) -> str:
    """Why a number of the type ``hint`` takes does not match it: out of range ("" when the
    type itself is wrong)."""
    if isinstance(value, list):
        items = [option.__args__[0] for option in getattr(hint, "__args__", ())
                 if _origin(option) is list] if _origin(hint) is Union else \
            [hint.__args__[0]] if _origin(hint) is list else []
        for item_hint in items:
            for item in value:
                problem = _out_of_range(item, item_hint)
                if problem:
                    return problem
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ""
    if isinstance(value, int) and _accepts(hint, int):
        return f"got {short_repr(value)}; integers in a config are {INT_RANGE}"
    if _accepts(hint, float) and not (isinstance(value, float) and not math.isfinite(value)):
        return (f"got {short_repr(value)}; beyond float32's range (magnitude at most "
                f"{FLOAT32_MAX:.4g}), where the number is used")
    return ""


def _accepts(hint: Any, kind: type) -> bool:
    """Whether ``hint`` is ``kind`` or a union holding it."""
    if hint is kind:
        return True
    if _origin(hint) is Union:
        return any(_accepts(option, kind) for option in hint.__args__)
    return False


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
        try:
            return float(value)
        except OverflowError:  # an int beyond every float: refused as it is
            return value
    if _origin(hint) is Union:
        conversions = [_coerce(value, option) for option in hint.__args__]
        for option, converted in zip(hint.__args__, conversions):
            if matches_hint(converted, option):
                return converted
        # None fits: the first conversion, so that its error is about the number it became.
        return next((c for c in conversions if c is not value), value)
    if _origin(hint) is list and isinstance(value, list):
        (item,) = hint.__args__
        return [_coerce(v, item) for v in value]
    if _origin(hint) is dict and isinstance(value, dict):
        return {k: _coerce(v, hint.__args__[1]) for k, v in value.items()}
    return value


def matches_hint(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type the annotation ``hint`` names (as the loader reads)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and \
            INT_MIN <= value <= INT_MAX
    if hint is float:
        return isinstance(value, float) and math.isfinite(value) and abs(value) <= FLOAT32_MAX
    if hint is str:
        return isinstance(value, str)
    origin = _origin(hint)
    if origin is Union:
        return any(matches_hint(value, option) for option in hint.__args__)
    if origin is list:
        return isinstance(value, list) and all(matches_hint(v, hint.__args__[0]) for v in value)
    if origin is dict:
        key_hint, value_hint = hint.__args__
        return isinstance(value, dict) and all(
            matches_hint(k, key_hint) and matches_hint(v, value_hint) for k, v in value.items()
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
