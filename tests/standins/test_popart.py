"""The PopART stand-in: what PopTorch programs take from ``import popart`` (PopART's enum values,
its logger, a SessionOptions bag), and a clear error for the rest."""
from __future__ import annotations

import pytest

import ipu_standins.popart as popart


def test_enum_values_are_popart_s():
    assert [int(m) for m in popart.SyntheticDataMode] == [0, 1, 2, 3]
    assert int(popart.RecomputationType.NoRecompute) == 0
    assert int(popart.RecomputationType.Pipeline) == 3  # poptorch's docs: 3 is Pipeline
    assert int(popart.RecomputationType.RecomputeAll) == 4
    assert [m.name for m in popart.VirtualGraphMode] == ["Off", "Manual", "Auto",
                                                         "ExecutionPhases"]
    assert [int(m) for m in popart.DeviceConnectionType] == [0, 1, 2]


def test_the_option_enums_optimum_graphcore_sets_are_popart_s():
    """IPUConfig.to_options sets accumulateOuterFragmentSettings.schedule and
    subgraphCopyingStrategy from these (the values of willow's sessionoptions.hpp)."""
    schedule = popart.AccumulateOuterFragmentSchedule
    assert [(m.name, int(m)) for m in schedule] == [
        ("Scheduler", 0), ("Serial", 1), ("OverlapCycleOptimized", 2),
        ("OverlapMemoryOptimized", 3)]
    assert [(m.name, int(m)) for m in popart.SubgraphCopyingStrategy] == [
        ("OnEnterAndExit", 0), ("JustInTime", 1)]
    # MergeVarUpdateType::None is Off in Python; AutoLoose comes before AutoTight.
    assert int(popart.MergeVarUpdateType.Off) == 0
    assert int(popart.MergeVarUpdateType.AutoLoose) == 2
    assert int(popart.MergeVarUpdateType.AutoTight) == 3
    assert int(popart.BatchSerializationBatchSchedule.OverlapOnCompute) == 3
    assert int(popart.ExecutionPhaseSchedule.BatchClusteredIO) == 2


def test_version():
    assert popart.versionString() == popart.__version__
    assert popart.versionNumber() == (3, 3, 0)


def test_logger_levels(capsys, monkeypatch):
    monkeypatch.setattr(popart, "_module_levels", {})
    logger = popart.getLogger()
    logger.info("hidden at the default level, WARN")
    logger.warn("shown")
    logger.setLevel("DEBUG")
    logger.debug("shown too")
    popart.getLogger("python").setLevel("ERR")
    logger.warn("hidden: the python module's own level is ERR")
    logger.critical("critical")
    popart.getLogger().setLevel("not a level")  # PopART turns logging off
    logger.critical("hidden")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["shown", "shown too", "critical"]
    assert [line.split()[1:2] for line in lines] == [["popart:python"]] * 3


def test_session_options_take_popart_s_names_only():
    options = popart.SessionOptions()
    options.enableStochasticRounding = True
    assert options.enableStochasticRounding is True
    with pytest.raises(AttributeError, match="was not set"):
        _ = options.enablePipelining
    with pytest.raises(AttributeError, match="has no attribute 'enableTurbo'"):
        options.enableTurbo = True


def test_what_is_not_modelled_says_so():
    with pytest.raises(AttributeError, match="'TrainingSession' in the PopART stand-in"):
        _ = popart.TrainingSession
