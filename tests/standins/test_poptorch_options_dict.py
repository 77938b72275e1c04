"""``OptionsDict``, the container behind ``poptorch.Options``, against PopTorch's
(python/_options_impl.py): only the keys given when it is made can be set, with a value of the
default's type; attributes read and write the values; private attributes are fixed once the
values are; frozen dictionaries (and the dictionaries they hold) refuse changes; copies start
unfrozen; ``update``/``toDict`` merge and log the pending warnings."""
from __future__ import annotations

import copy
import logging
import pickle

import pytest

from ipu_standins.poptorch._options_dict import FROZEN_MESSAGE, OptionsDict


class _Nested(OptionsDict):
    def __init__(self):
        self._inner = OptionsDict(depth=1)  # declared before the values, as Options does
        super().__init__(name="outer", ratio=0.5)


def test_only_known_keys_of_the_default_s_type_can_be_set():
    options = OptionsDict(iterations=1, name="x")
    options.set(iterations=3)
    options.name = "y"
    assert (options.iterations, options("name")) == (3, "y")
    assert options.exists("iterations") and not options.exists("other")
    with pytest.raises(AssertionError, match="^Invalid option other, valid options are"):
        options.set(other=1)
    with pytest.raises(AssertionError, match="^Unexpected type <class 'str'> for option "
                                             "iterations. Expected <class 'int'>$"):
        options.iterations = "4"
    options.set(iterations=True)  # a bool is an int, as isinstance says
    assert options.iterations is True


def test_create_or_set_adds_keys_and_delete_if_exists_removes_them():
    options = OptionsDict(iterations=1)
    options.createOrSet(extra=2.0, iterations=5)
    assert options.toDict() == {"iterations": 5, "extra": 2.0}
    with pytest.raises(AssertionError, match="Unexpected type"):
        options.createOrSet(extra="x")  # an existing key keeps its type
    options.deleteIfExists("extra")
    options.deleteIfExists("extra")  # absent: nothing happens
    assert options.toDict() == {"iterations": 5}


def test_unknown_attributes_and_late_private_attributes_are_refused():
    options = OptionsDict(iterations=1)
    with pytest.raises(AttributeError, match=r"^Invalid attribute other\.$"):
        options.other  # noqa: B018
    with pytest.raises(AttributeError, match="^Invalid private attribute _late"):
        options._late = 1
    assert not hasattr(options, "_late")
    options._is_frozen = False  # a declared private attribute can be written
    assert _Nested()._inner.depth == 1


def test_update_merges_into_the_other_dictionary_and_refuses_shared_keys():
    options = OptionsDict(a=1, b="x")
    other = {"c": 3}
    assert options.update(other) is other and other == {"a": 1, "b": "x", "c": 3}
    with pytest.raises(AssertionError, match="some keys in common"):
        options.update({"a": 2})
    snapshot = options.toDict()
    snapshot["a"] = 9
    assert options.a == 1  # toDict returns a new dictionary


def test_update_logs_each_warning_that_is_not_disabled(caplog):
    options = OptionsDict(a=1)
    options._warnings["a"] = "a default changed"
    options._warnings["b"] = "b is deprecated"
    options._warnings_disabled.add("b is deprecated")
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        options.toDict()
    messages = [r.getMessage() for r in caplog.records if r.name == "poptorch::python"]
    assert messages == ["a default changed"]


def test_frozen_dictionaries_and_the_dictionaries_they_hold_refuse_changes():
    options = _Nested()
    options._freeze()
    for change in (lambda: options.set(ratio=1.0), lambda: setattr(options, "name", "n"),
                   lambda: options.createOrSet(new=1), lambda: options._inner.set(depth=2)):
        with pytest.raises(AttributeError, match=f"^{FROZEN_MESSAGE}$"):
            change()
    assert (options.ratio, options.name, options._inner.depth) == (0.5, "outer", 1)
    options._unfreeze()
    options._inner.depth = 2
    options.ratio = 1.0
    assert (options.ratio, options._inner.depth) == (1.0, 2)


def test_a_deep_copy_is_unfrozen_and_independent():
    options = _Nested()
    options._freeze()
    clone = copy.deepcopy(options)
    clone.ratio = 2.0
    clone._inner.depth = 3
    assert (options.ratio, options._inner.depth) == (0.5, 1)
    assert options._is_frozen and not clone._is_frozen


def test_a_pickled_dictionary_keeps_its_values_and_its_state():
    options = _Nested()
    options.ratio = 0.25
    options._freeze()
    restored = pickle.loads(pickle.dumps(options))
    assert restored.toDict() == {"name": "outer", "ratio": 0.25}
    with pytest.raises(AttributeError, match=FROZEN_MESSAGE):
        restored.ratio = 1.0


def test_repr_lists_the_values_then_the_private_attributes():
    assert repr(OptionsDict(a=1, b="x")) == (
        "OptionsDict(a=1, b='x', _warnings={}, _warnings_disabled=set(), _is_frozen=False)")
