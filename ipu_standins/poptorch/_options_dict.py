"""The option containers behind ``poptorch.Options``: a dictionary whose keys are fixed when
it is made (a name PopTorch does not have is refused, as PopTorch refuses it), frozen once a
model or a data loader has taken the options; merging them logs the warnings they hold."""
from __future__ import annotations

import copy
from typing import Any, Dict

from ._logging import logger

__all__ = ["OptionsDict", "FROZEN_MESSAGE"]

FROZEN_MESSAGE = "Can't modify frozen Options"


class OptionsDict:
    """Options stored in ``_values``; only the keys given to the constructor can be set with
    :meth:`set` (:meth:`createOrSet` adds one). Attribute reads and writes go to the values;
    private attributes must be declared before ``_values`` is."""

    def __init__(self, **defaults: Any) -> None:
        self._warnings: Dict[str, str] = {}
        self._warnings_disabled: set = set()
        self._is_frozen = False
        self._values = defaults  # last: from here on unknown attributes are refused

    # -- the dictionary
    def set(self, **kwargs: Any) -> None:
        self.checkIsFrozen()
        for option, value in kwargs.items():
            assert self.exists(option), (
                f"Invalid option {option}, valid options are {self._values.keys()}")
            assert isinstance(value, type(self._values[option])), (
                f"Unexpected type {type(value)} for option {option}. "
                f"Expected {type(self._values[option])}")
            self._values[option] = value

    def createOrSet(self, **kwargs: Any) -> None:
        self.checkIsFrozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value

    def exists(self, option: str) -> bool:
        return option in self._values

    def deleteIfExists(self, option: str) -> None:
        self._values.pop(option, None)

    def update(self, other: Dict[str, Any]) -> Dict[str, Any]:
        for warning in self._warnings.values():
            if warning not in self._warnings_disabled:
                logger.warning(warning)
        assert not set(self._values).intersection(other), (
            "Can't merge dictionaries, they have some keys in common")
        other.update(self._values)
        return other

    def toDict(self) -> Dict[str, Any]:
        return self.update({})

    def __call__(self, option: str) -> Any:
        return getattr(self, option)

    # -- freezing
    def _has(self, name: str) -> bool:
        if name == "__class__":
            return True
        if name.startswith("_"):
            return name in self.__dict__
        return name in self.__dict__.get("_values", {})

    def _set_frozen(self, frozen: bool) -> None:
        object.__setattr__(self, "_is_frozen", frozen)
        for value in list(self.__dict__.values()):
            if isinstance(value, OptionsDict):
                value._set_frozen(frozen)
            elif hasattr(value, "_is_frozen") and not isinstance(value, type):
                value._is_frozen = frozen

    def _freeze(self) -> None:
        self._set_frozen(True)

    def _unfreeze(self) -> None:
        self._set_frozen(False)

    def checkIsFrozen(self, option: Any = None) -> None:
        if self.__dict__.get("_is_frozen") and option != "_is_frozen":
            raise AttributeError(FROZEN_MESSAGE)

    # -- copies and pickles
    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        result = type(self).__new__(type(self))
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            object.__setattr__(result, key,
                               False if key == "_is_frozen" else copy.deepcopy(value, memo))
        return result

    def __getstate__(self) -> Dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- attributes
    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__"):  # __class__: a subclass may replace the class (popdist)
            object.__setattr__(self, name, value)
            return
        self.checkIsFrozen(name)
        if name.startswith("_"):
            if "_values" in self.__dict__ and name not in self.__dict__:
                raise AttributeError(f"Invalid private attribute {name}. Valid attributes: "
                                     f"{list(self.__dict__.keys())}")
            object.__setattr__(self, name, value)
        else:
            self.set(**{name: value})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or not self._has(name):
            raise AttributeError(f"Invalid attribute {name}.")
        if name.startswith("_"):
            return self.__dict__[name]
        return self.__dict__["_values"][name]

    def __repr__(self) -> str:
        values = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        private = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "_values")
        return f"{type(self).__name__}({values}, {private})"
