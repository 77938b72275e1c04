"""``poptorch.poptorch_core`` of the PopTorch stand-in against PopTorch's C++ module
(python/poptorch.cpp, popart_compiler/) and its tests (tests/misc_test.py): the error classes
and what ``_throwTestError`` raises, the hardware and tracing queries, and the backend's check
of the options it is given."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch import poptorch_core
from ipu_standins.poptorch.poptorch_core import _throwTestError, _validateOptions

Errors = poptorch_core.TestErrorType  # not named Test*: pytest would collect it

# The C++ enum's order (popart_compiler/types/include/popart_compiler/CompilerTypes.hpp).
TEST_ERRORS = ["Poptorch", "Popart", "PopartInternal", "Poplibs", "PoplarUnrecoverable",
               "PoplarUnknown", "PoplarRecoverableFullReset", "PoplarLinkError"]
LEVELS = ("throwTestError::topLevel", "throwTestError::bottomLevel")


def test_the_error_classes_are_poptorch_s():
    assert poptorch.Error is poptorch_core.Error and issubclass(poptorch.Error, RuntimeError)
    for kind in (poptorch.RecoverableError, poptorch.UnrecoverableError):
        assert issubclass(kind, poptorch.Error)
    assert not issubclass(poptorch.RecoverableError, poptorch.UnrecoverableError)
    error = poptorch.Error("went wrong")
    assert (error.message, error.type, error.location) == ("went wrong", "poptorch_cpp_error", "")


def test_test_error_types_in_the_cpp_order():
    assert [(m.name, m.value) for m in Errors] == [
        (name, index) for index, name in enumerate(TEST_ERRORS)]


@pytest.mark.parametrize("error_type", list(Errors))
def test_every_test_error_is_a_poptorch_error_with_its_location(error_type):
    with pytest.raises(poptorch.Error) as caught:
        _throwTestError(error_type)
    error = caught.value
    for level in LEVELS:
        assert level in error.args[0]
        assert error.location.count(level) == 1
        assert level not in error.message  # the message carries no backtrace


def test_the_recoverable_unrecoverable_and_link_errors():
    with pytest.raises(poptorch.RecoverableError) as recoverable:
        _throwTestError(Errors.PoplarRecoverableFullReset)
    assert recoverable.value.recovery_action == "FULL_RESET"
    assert recoverable.value.type == "poplar_recoverable_runtime_error"
    with pytest.raises(poptorch.UnrecoverableError) as unrecoverable:
        _throwTestError(Errors.PoplarUnrecoverable)
    assert unrecoverable.value.type == "poplar_unrecoverable_runtime_error"
    with pytest.raises(poptorch.Error) as link:
        _throwTestError(Errors.PoplarLinkError)
    assert link.value.type == "poplar_link_error"
    assert "-lfoo not found" in link.value.message
    assert not isinstance(link.value, (poptorch.RecoverableError, poptorch.UnrecoverableError))


def test_no_hardware_for_any_number_of_ipus(monkeypatch):
    monkeypatch.delenv("IPU_UNIT_SCALING_EMULATED_IPUS", raising=False)
    assert poptorch_core.ipuHardwareVersion() == 0
    assert poptorch_core.ipuHardwareVersion(numIpus=4) == 0
    assert not poptorch.ipuHardwareIsAvailable()
    # PopTorch's ipuHardwareVersion() asserts that there is hardware.
    with pytest.raises(AssertionError, match="No IPU hardware available on this system"):
        poptorch.ipuHardwareVersion()


def test_a_saved_executable_cannot_be_read_without_the_sdk():
    with pytest.raises(poptorch.Error, match="model.poptorch"):
        poptorch_core.importPoptorchMetadataFromFile("model.poptorch")


class _Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(poptorch_core.isCompilingWithDispatcher())
        return x * 2


def test_compiling_with_the_dispatcher_only_while_a_model_is_traced():
    probe = _Probe()
    assert not poptorch_core.isCompilingWithDispatcher()
    probe(torch.ones(2))
    poptorch.inferenceModel(probe)(torch.ones(2))
    assert probe.seen[0] is False and probe.seen[1:] and all(probe.seen[1:])
    assert not poptorch_core.isCompilingWithDispatcher()


def test_the_options_poptorch_sets_are_valid():
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(4)
    _validateOptions(opts.toDict())
    _validateOptions({"experimentalSettings.foo": 1, "location_weight": {"a": 1},
                      "compilation_progress_bar_fn": lambda done, total: None})


@pytest.mark.parametrize("value, kind", [(True, "bool"), (3, "int"), (0.5, "float"),
                                         ("x", "string"), ({"a": 1}, "map"),
                                         ([1, 2], "container"),
                                         (poptorch.OutputMode.All, "int")])
def test_an_unknown_option_is_refused_naming_its_type(value, kind):
    with pytest.raises(poptorch.Error, match=f"^Unknown {kind} option notAnOption$"):
        _validateOptions({"notAnOption": value})


def test_a_value_the_backend_cannot_take_is_refused():
    with pytest.raises(poptorch.Error, match="^Unknown value type Tensor for option "
                                             "device_iterations$"):
        _validateOptions({"device_iterations": torch.tensor(1)})
